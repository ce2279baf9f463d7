"""gpt-oss sizes: a debug model and the two published ones (openai/gpt-oss-20b and -120b;
their config.json: 2880 wide, 64 query heads of 64 over 8 kv heads, experts of 2880, top-4,
every other block a 128-token window starting with block 0, YaRN x32 from 4096 positions)."""

from dataclasses import replace

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

GPT_OSS = {
    "qkv_bias": True,
    "attention_out_bias": True,
    "attention_sinks": True,
    "router_bias": True,
    "expert_bias": True,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
    "norm_topk_prob": True,
}
"""The flags every gpt-oss has."""

_YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def _full_every_other(num_layers: int) -> tuple[int, ...]:
    """Blocks 1, 3, 5, ... attend to every key; 0, 2, 4, ... slide (gpt-oss's layer_types)."""
    return tuple(range(1, num_layers, 2))


GPT_OSS_20B = TransformerConfig(
    family="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=150000.0,
    rope_scaling=_YARN,
    sliding_window=128,
    full_attention_layers=_full_every_other(24),
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    router_aux_loss_coef=0.9,
    dtype="bfloat16",
    **GPT_OSS,
)
FLAVORS = {
    "debug": replace(debug_flavor(
        "gpt_oss",
        head_dim=16,
        rope_theta=150000.0,
        rope_scaling={**_YARN, "factor": 4.0, "original_max_position_embeddings": 64},
        sliding_window=8,
        full_attention_layers=_full_every_other(2),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        router_aux_loss_coef=0.01,
        **GPT_OSS,
    ), intermediate_size=32),
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": replace(
        GPT_OSS_20B, num_layers=36, full_attention_layers=_full_every_other(36), num_experts=128
    ),
}
