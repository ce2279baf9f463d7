"""Gemma 2 sizes: a debug model and Gemma-2-2B / 9B (window 4096 on even blocks)."""

from typing import Any

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

GEMMA = {
    "hidden_act": "gelu_tanh",
    "norm_unit_offset": True,
    "post_norms": True,
    "scale_embeddings": True,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "norm_eps": 1e-6,
}
"""The flags every Gemma 2 has."""


def _gemma2(num_layers: int, **sizes: Any) -> TransformerConfig:
    return TransformerConfig(
        family="gemma2",
        vocab_size=256000,
        num_layers=num_layers,
        head_dim=256,
        query_pre_attn_scalar=256,
        max_position_embeddings=8192,
        sliding_window=4096,
        full_attention_layers=tuple(range(1, num_layers, 2)),
        dtype="bfloat16",
        **GEMMA,
        **sizes,
    )


FLAVORS = {
    "debug": debug_flavor(
        "gemma2",
        query_pre_attn_scalar=24,
        sliding_window=16,
        full_attention_layers=(1,),
        **GEMMA,
    ),
    # google/gemma-2-2b
    "gemma2-2b": _gemma2(26, hidden_size=2304, intermediate_size=9216, num_heads=8, num_kv_heads=4),
    # google/gemma-2-9b
    "gemma2-9b": _gemma2(
        42, hidden_size=3584, intermediate_size=14336, num_heads=16, num_kv_heads=8
    ),
}
