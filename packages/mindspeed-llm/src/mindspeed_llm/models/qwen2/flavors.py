"""Qwen2 / Qwen2.5 sizes (q/k/v biases): a CPU-sized debug model and Qwen2.5-7B."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

DEBUG = debug_flavor("qwen2", norm_eps=1e-6, qkv_bias=True)
FLAVORS = {
    "debug": DEBUG,
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": TransformerConfig(
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        dtype="bfloat16",
    ),
    "qwen2.5-72b": TransformerConfig(
        family="qwen2",
        vocab_size=152064,
        hidden_size=8192,
        intermediate_size=29568,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        norm_eps=1e-5,
        qkv_bias=True,
        dtype="bfloat16",
    ),
}
