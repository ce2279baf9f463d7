"""InternLM3 sizes: a debug model and InternLM3-8B (GQA 32/2, head 128, RoPE base 5e7).

The published config.json also names `rope_scaling: dynamic` (NTK scaling past the trained
length), which we do not build: reading it says so; this flavor is the model within its
32768 positions, where dynamic scaling changes nothing."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# internlm/internlm3-8b-instruct
INTERNLM3_8B = TransformerConfig(
    family="internlm3",
    vocab_size=128512,
    hidden_size=4096,
    intermediate_size=10240,
    num_layers=48,
    num_heads=32,
    num_kv_heads=2,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=50000000.0,
    norm_eps=1e-5,
    dtype="bfloat16",
)
FLAVORS = {"debug": debug_flavor("internlm3"), "internlm3-8b": INTERNLM3_8B}
