"""GLM sizes: a debug model and GLM-4-9B-chat (GQA 32/2, head 128, RoPE on 64 channels)."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# THUDM/glm-4-9b-chat-hf (config.json)
GLM_4_9B_CHAT = TransformerConfig(
    family="glm",
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=13696,
    num_layers=40,
    num_heads=32,
    num_kv_heads=2,
    head_dim=128,
    rotary_dim=64,
    max_position_embeddings=131072,
    rope_theta=10000.0,
    norm_eps=1.5625e-07,
    qkv_bias=True,
    dtype="bfloat16",
)
FLAVORS = {
    "debug": debug_flavor("glm", rotary_dim=8, qkv_bias=True),
    "glm-4-9b-chat": GLM_4_9B_CHAT,
}
