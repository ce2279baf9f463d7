"""Mixtral sizes (Mistral attention, 8 routed SwiGLU experts, top-2): debug and 8x7B."""

from mindspeed_llm.models.config import TransformerConfig

FLAVORS = {
    "debug": TransformerConfig(
        family="mixtral",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        norm_eps=1e-5,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_aux_loss_coef=0.01,
    ),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": TransformerConfig(
        family="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        norm_eps=1e-5,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        router_aux_loss_coef=0.02,
        dtype="bfloat16",
    ),
}
