"""Gemma 3 text sizes: a debug model and Gemma-3-1B (window 512, every 6th block full)."""

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.config import TransformerConfig

GEMMA3 = {
    "hidden_act": "gelu_tanh",
    "norm_unit_offset": True,
    "post_norms": True,
    "scale_embeddings": True,
    "qk_norm": True,
    "tie_word_embeddings": True,
    "norm_eps": 1e-6,
    "local_rope_theta": 10000.0,
}
"""The flags every Gemma 3 has."""

FLAVORS = {
    "debug": debug_flavor(
        "gemma3",
        query_pre_attn_scalar=24,
        sliding_window=16,
        full_attention_layers=(1,),
        rope_theta=1000000.0,
        **GEMMA3,
    ),
    # google/gemma-3-1b-pt
    "gemma3-1b": TransformerConfig(
        family="gemma3",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        sliding_window=512,
        full_attention_layers=tuple(range(5, 26, 6)),
        dtype="bfloat16",
        **GEMMA3,
    ),
}
