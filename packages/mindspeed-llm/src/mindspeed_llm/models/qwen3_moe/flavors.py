"""Qwen3-MoE sizes (Qwen3 attention with qk-norm, 128 routed experts top-8, no shared
expert): a debug model and Qwen3-30B-A3B."""

from dataclasses import replace

from mindspeed_llm.models.qwen3.flavors import DEBUG as QWEN3_DEBUG
from mindspeed_llm.models.qwen3.flavors import QWEN3_8B

_EXPERTS = {"norm_topk_prob": True, "router_aux_loss_coef": 0.001}
FLAVORS = {
    "debug": replace(
        QWEN3_DEBUG,
        family="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **_EXPERTS,
    ),
    # Qwen/Qwen3-30B-A3B: Qwen3 attention (32 heads of 128 over 4 kv heads), 48 blocks.
    "qwen3-30b-a3b": replace(
        QWEN3_8B,
        family="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_kv_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        **_EXPERTS,
    ),
}
