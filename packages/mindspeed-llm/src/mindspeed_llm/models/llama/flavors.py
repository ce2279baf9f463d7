"""Llama sizes: a CPU-sized debug model and the published Llama 2 / Llama 3 hyperparameters."""

from dataclasses import replace

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# meta-llama/Llama-2-7b-hf
LLAMA2_7B = TransformerConfig(
    family="llama",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    norm_eps=1e-5,
    dtype="float16",
)
# meta-llama/Meta-Llama-3-8B: a larger vocabulary and feed-forward, GQA, rope_theta 500k.
LLAMA3_8B = replace(
    LLAMA2_7B,
    vocab_size=128256,
    intermediate_size=14336,
    num_kv_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    dtype="bfloat16",
)
FLAVORS = {
    "debug": debug_flavor("llama"),
    # the debug model with heads of 32 channels (vLLM's CPU attention takes no narrower)
    "debug-h32": debug_flavor("llama", head_dim=32),
    "llama2-7b": LLAMA2_7B,
    "llama3-8b": LLAMA3_8B,
    # meta-llama/Llama-3.1-8B: Llama 3 with llama3 RoPE scaling to 128k.
    "llama3.1-8b": replace(
        LLAMA3_8B,
        max_position_embeddings=131072,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
