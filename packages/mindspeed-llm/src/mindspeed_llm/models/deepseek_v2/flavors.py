"""DeepSeek-V2 sizes: a CPU-sized debug model and the published V2-Lite (16B, 2.4B active)."""

from mindspeed_llm.models.config import TransformerConfig

_DEEPSEEK_V2 = {
    "family": "deepseek_v2",
    "router_score": "softmax",
    "norm_topk_prob": False,
    "expert_group_score": "max",
    "shared_expert_gated": False,
    "rope_interleaved": True,
    "norm_eps": 1e-6,
}
"""What every DeepSeek-V2 has: softmax routing without renormalisation, ungated shared
experts, interleaved RoPE."""

FLAVORS = {
    # 3 blocks (the first dense), full-rank queries as V2-Lite, 8 experts in 4 groups, top-3
    # from the best 2 groups (group-limited as the 236B model routes; with top_k at most
    # topk_expert_groups the limit would never bind), scaled weights.
    "debug": TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        head_dim=24,
        max_position_embeddings=256,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_expert_groups=4,
        topk_expert_groups=2,
        routed_scaling_factor=2.0,
        mlp_only_layers=(0,),
        **_DEEPSEEK_V2,
    ),
    # deepseek-ai/DeepSeek-V2-Lite (config.json): 27 blocks, the first dense; 64 routed
    # experts, top-6 greedy, 2 shared; no q compression; YaRN x40 from 4K to 160K.
    "deepseek-v2-lite": TransformerConfig(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_layers=27,
        num_heads=16,
        head_dim=192,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=2816,
        routed_scaling_factor=1.0,
        mlp_only_layers=(0,),
        dtype="bfloat16",
        **_DEEPSEEK_V2,
    ),
}
