"""MiniMax-M2 sizes: a CPU-sized debug model and the published MiniMax-M2 (230B, 10B
active; MiniMaxAI/MiniMax-M2 config.json as published in 2025)."""

from mindspeed_llm.models.config import TransformerConfig

_MINIMAX = {
    "family": "minimax_m2",
    "qk_norm": True,
    "qk_norm_scope": "all",
    "router_score": "sigmoid",
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "router_bias_update_rate": 0.001,  # the e_score_correction_bias is loss-free balancing
}
"""What every MiniMax-M2 has: one q and one k RMSNorm over all heads, sigmoid routing with
the balancing bias in every block (RoPE on half of each head)."""

FLAVORS = {
    # 2 blocks, 4 heads of 32 over 2 kv heads, RoPE on 16 channels, 8 experts top-2.
    "debug": TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rotary_dim=16,
        max_position_embeddings=256,
        norm_eps=1e-6,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **_MINIMAX,
    ),
    # MiniMaxAI/MiniMax-M2: 62 blocks, 48 heads of 128 over 8 kv heads (RoPE on 64), 256
    # experts of 1536 top-8, a 196K context.
    "minimax-m2": TransformerConfig(
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=1536,
        num_layers=62,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        rotary_dim=64,
        max_position_embeddings=196608,
        rope_theta=5000000.0,
        norm_eps=1e-6,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        dtype="bfloat16",
        **_MINIMAX,
    ),
}
