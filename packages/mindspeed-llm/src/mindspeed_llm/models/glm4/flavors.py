"""GLM-4 sizes: a debug model and GLM-4-9B-0414 (GQA 32/2, head 128, RoPE on 64 channels)."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

GLM4 = {"qkv_bias": True, "post_norms": True}
"""The flags every GLM-4 has (and `rotary_dim` = head_dim / 2)."""

# THUDM/GLM-4-9B-0414
GLM4_9B = TransformerConfig(
    family="glm4",
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=13696,
    num_layers=40,
    num_heads=32,
    num_kv_heads=2,
    head_dim=128,
    rotary_dim=64,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    norm_eps=1e-5,
    dtype="bfloat16",
    **GLM4,
)
FLAVORS = {"debug": debug_flavor("glm4", rotary_dim=8, **GLM4), "glm4-9b": GLM4_9B}
