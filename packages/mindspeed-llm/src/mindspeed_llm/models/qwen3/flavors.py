"""Qwen3 sizes (per-head q/k RMSNorm, explicit head_dim): a debug model and Qwen3-8B."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# As in Qwen3, heads * head_dim need not equal hidden_size.
DEBUG = debug_flavor("qwen3", head_dim=32, norm_eps=1e-6, qk_norm=True)
# Qwen/Qwen3-8B
QWEN3_8B = TransformerConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    norm_eps=1e-6,
    qk_norm=True,
    dtype="bfloat16",
)
FLAVORS = {"debug": DEBUG, "qwen3-8b": QWEN3_8B}
