"""Qwen2-MoE sizes (qkv bias, 60 routed experts top-4 plus a gated shared expert):
a debug model and Qwen1.5-MoE-A2.7B."""

from dataclasses import replace

from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.qwen2.flavors import DEBUG as QWEN2_DEBUG

FLAVORS = {
    "debug": replace(
        QWEN2_DEBUG,
        family="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen1.5-moe-a2.7b": TransformerConfig(
        family="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
        dtype="bfloat16",
    ),
}
