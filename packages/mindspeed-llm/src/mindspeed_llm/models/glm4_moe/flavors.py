"""GLM-4.5 sizes: a CPU-sized debug model and the published GLM-4.5, GLM-4.5-Air and GLM-4.6.

The published sizes are those of zai-org/GLM-4.5, zai-org/GLM-4.5-Air and zai-org/GLM-4.6
config.json (as published in 2025; transformers' Glm4MoeConfig defaults are GLM-4.5-Air's).
"""

from dataclasses import replace

from mindspeed_llm.models.config import TransformerConfig

_GLM = {
    "family": "glm4_moe",
    "qkv_bias": True,
    "router_score": "sigmoid",
    "norm_topk_prob": True,
    "shared_expert_gated": False,
    "router_bias_update_rate": 0.001,  # GLM-4.5 balances its sigmoid router loss-free
}
"""What every GLM-4.5 has: q/k/v biases, sigmoid routing with the balancing bias, ungated
shared experts (and RoPE on half of each head)."""

FLAVORS = {
    # 3 blocks (the first dense), per-head qk-norm, RoPE on 16 of 32 channels, 8 experts
    # in 4 groups (2 chosen), one shared expert, one MTP module.
    "debug": TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rotary_dim=16,
        qk_norm=True,
        max_position_embeddings=256,
        norm_eps=1e-5,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_expert_groups=4,
        topk_expert_groups=2,
        routed_scaling_factor=2.5,
        mlp_only_layers=(0,),
        num_nextn_predict_layers=1,
        **_GLM,
    ),
    # zai-org/GLM-4.5 (355B, 32B active): 92 blocks, the first 3 dense; 96 heads of 128 over
    # 8 kv heads, qk-norm; 160 routed experts top-8 and one shared; one MTP module.
    "glm-4.5": TransformerConfig(
        vocab_size=151552,
        hidden_size=5120,
        intermediate_size=12288,
        num_layers=92,
        num_heads=96,
        num_kv_heads=8,
        head_dim=128,
        rotary_dim=64,
        qk_norm=True,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        norm_eps=1e-5,
        num_experts=160,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        shared_expert_intermediate_size=1536,
        routed_scaling_factor=2.5,
        mlp_only_layers=(0, 1, 2),
        num_nextn_predict_layers=1,
        dtype="bfloat16",
        **_GLM,
    ),
}
# zai-org/GLM-4.5-Air (106B, 12B active): 46 blocks, the first dense; no qk-norm; 128
# routed experts top-8 and one shared, routed_scaling_factor 1.
FLAVORS["glm-4.5-air"] = replace(
    FLAVORS["glm-4.5"],
    hidden_size=4096,
    intermediate_size=10944,
    num_layers=46,
    qk_norm=False,
    num_experts=128,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=1408,
    routed_scaling_factor=1.0,
    mlp_only_layers=(0,),
)
# zai-org/GLM-4.6: GLM-4.5's sizes with a 200K context (max_position_embeddings 202752).
FLAVORS["glm-4.6"] = replace(FLAVORS["glm-4.5"], max_position_embeddings=202752)
