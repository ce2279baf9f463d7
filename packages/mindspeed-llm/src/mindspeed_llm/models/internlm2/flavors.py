"""InternLM2 sizes: a debug model and InternLM2.5-7B (GQA 32/8, head 128, RoPE base 1e6).

The published config.json also names `rope_scaling: dynamic` (factor 2, NTK scaling past
the trained length), which we do not build: reading it says so; this flavor is the model
within its 32768 positions, where dynamic scaling changes nothing."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

# internlm/internlm2_5-7b (config.json)
INTERNLM2_5_7B = TransformerConfig(
    family="internlm2",
    vocab_size=92544,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    norm_eps=1e-5,
    dtype="bfloat16",
)
FLAVORS = {"debug": debug_flavor("internlm2"), "internlm2_5-7b": INTERNLM2_5_7B}
