"""Mistral sizes: a debug model with a sliding window, and Mistral-7B v0.1 (window 4096)."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# mistralai/Mistral-7B-v0.1
MISTRAL_7B = TransformerConfig(
    family="mistral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    norm_eps=1e-5,
    sliding_window=4096,
    dtype="bfloat16",
)
FLAVORS = {
    "debug": debug_flavor("mistral", sliding_window=16),
    "mistral-7b": MISTRAL_7B,
}
