"""Qwen3-Next sizes: a debug model and Qwen3-Next-80B-A3B (its config.json: 48 blocks, every
4th full attention with 16 query heads of 256 over 2 kv heads, a quarter of each head
rotated; linear blocks with 16 key heads and 32 value heads of 128; 512 experts of 512, top
10, a shared expert of 512)."""

from dataclasses import replace

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

QWEN3_NEXT = {
    "qk_norm": True,
    "norm_unit_offset": True,
    "attention_output_gate": True,
    "norm_topk_prob": True,
    "norm_eps": 1e-6,
    "router_aux_loss_coef": 0.001,
    "linear_conv_kernel_dim": 4,
}
"""The flags every Qwen3-Next has."""


def linear_layers(num_layers: int, interval: int = 4) -> tuple[int, ...]:
    """Every block but each `interval`-th is linear attention (`full_attention_interval`)."""
    return tuple(i for i in range(num_layers) if (i + 1) % interval)


FLAVORS = {
    "debug": replace(debug_flavor(
        "qwen3_next",
        head_dim=32,
        rotary_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **QWEN3_NEXT,
    ), num_layers=4, linear_attention_layers=linear_layers(4, 2)),
    # Qwen/Qwen3-Next-80B-A3B-Instruct
    "qwen3-next-80b-a3b": TransformerConfig(
        family="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_layers=48,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        rotary_dim=64,
        max_position_embeddings=262144,
        rope_theta=10000000.0,
        linear_attention_layers=linear_layers(48),
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        dtype="bfloat16",
        **QWEN3_NEXT,
    ),
}
