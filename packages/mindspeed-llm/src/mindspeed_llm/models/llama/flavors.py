"""Llama sizes: a CPU-sized debug model and the published Llama 2 / Llama 3 hyperparameters."""

from mindspeed_llm.models.config import TransformerConfig

FLAVORS = {
    "debug": TransformerConfig(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        norm_eps=1e-5,
    ),
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": TransformerConfig(
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
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": TransformerConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        dtype="bfloat16",
    ),
    # meta-llama/Llama-3.1-8B: Llama 3 with llama3 RoPE scaling to 128k.
    "llama3.1-8b": TransformerConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        norm_eps=1e-5,
        dtype="bfloat16",
    ),
}
