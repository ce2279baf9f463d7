"""DeepSeek-V3 sizes: a CPU-sized debug model and the published 671B (37B active)."""

from mindspeed_llm.models.config import TransformerConfig

_DEEPSEEK = {
    "family": "deepseek_v3",
    "router_score": "sigmoid",
    "norm_topk_prob": True,
    "shared_expert_gated": False,
    "rope_interleaved": True,
    "norm_eps": 1e-6,
}
"""What every DeepSeek-V3 has: sigmoid routing, ungated shared experts, interleaved RoPE."""

FLAVORS = {
    # 3 blocks (the first dense), low-rank queries, 8 experts in 4 groups, one MTP module.
    "debug": TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        head_dim=24,
        max_position_embeddings=256,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_expert_groups=4,
        topk_expert_groups=2,
        routed_scaling_factor=2.5,
        mlp_only_layers=(0,),
        num_nextn_predict_layers=1,
        router_bias_update_rate=0.001,
        **_DEEPSEEK,
    ),
    # deepseek-ai/DeepSeek-V3 (config.json): 61 blocks, the first 3 dense; 256 routed
    # experts in 8 groups (4 chosen), top-8, one shared expert; YaRN x40 from 4K to 160K.
    "deepseek-v3": TransformerConfig(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        head_dim=192,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        shared_expert_intermediate_size=2048,
        num_expert_groups=8,
        topk_expert_groups=4,
        routed_scaling_factor=2.5,
        mlp_only_layers=(0, 1, 2),
        num_nextn_predict_layers=1,
        router_bias_update_rate=0.001,
        dtype="bfloat16",
        **_DEEPSEEK,
    ),
}
