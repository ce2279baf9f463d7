"""The planner's view of our models: `model_shape(TransformerConfig) -> ModelShape`."""

from __future__ import annotations

from mindspeed_core.planning import ModelShape
from mindspeed_llm.models.config import TransformerConfig


def model_shape(config: TransformerConfig, name: str | None = None) -> ModelShape:
    """Sizes of the decoder `config` describes, for `mindspeed_core.planning`."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    return ModelShape(
        name=name or config.family,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm,
        tie_word_embeddings=config.tie_word_embeddings,
        num_experts=config.num_experts,
        num_moe_layers=moe_layers,
        num_experts_per_tok=config.num_experts_per_tok if config.num_experts else 0,
        moe_intermediate_size=config.moe_intermediate_size or 0,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
    )
