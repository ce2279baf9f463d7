"""Qwen3-MoE sizes (Qwen3 attention with qk-norm, 128 routed experts top-8, no shared
expert): a debug model and Qwen3-30B-A3B."""

from mindspeed_llm.models.config import TransformerConfig

FLAVORS = {
    "debug": TransformerConfig(
        family="qwen3_moe",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        norm_eps=1e-6,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": TransformerConfig(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        dtype="bfloat16",
    ),
}
