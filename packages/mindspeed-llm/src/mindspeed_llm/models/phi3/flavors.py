"""Phi-3 sizes: a debug model and Phi-3-mini-4k-instruct (MHA, window 2047).

Phi-3.5-mini and the 128k Phi-3 models use `longrope` RoPE scaling, which we do not build
(reading their config.json says so)."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# microsoft/Phi-3-mini-4k-instruct
PHI3_MINI_4K = TransformerConfig(
    family="phi3",
    vocab_size=32064,
    hidden_size=3072,
    intermediate_size=8192,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    norm_eps=1e-5,
    sliding_window=2047,
    dtype="bfloat16",
)
FLAVORS = {"debug": debug_flavor("phi3"), "phi3-mini-4k": PHI3_MINI_4K}
