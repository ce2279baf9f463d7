"""Gemma 2 in Hugging Face's spelling: the shared decoder keys, `hidden_activation`
gelu_pytorch_tanh, the soft caps, `query_pre_attn_scalar`, and `layer_types` naming the
blocks with the sliding window. Weight names are the dense adapter's with
`post_norms` (pre/post feed-forward and post-attention layernorms)."""

from __future__ import annotations

from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.config import TransformerConfig

ACT = "gelu_pytorch_tanh"


def read_gemma(hf: dict[str, Any]) -> dict[str, Any]:
    """Our Gemma flags from a Gemma 2 (or 3) config.json."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not supported")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    window = hf.get("sliding_window")
    return {
        "hidden_act": "gelu_tanh",
        "norm_unit_offset": True,
        "post_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "sliding_window": window,
        "full_attention_layers": tuple(
            i for i, t in enumerate(types) if t == "full_attention" and window is not None
        ),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def write_gemma(config: TransformerConfig) -> dict[str, Any]:
    """Gemma 2's (and 3's) own config.json keys."""

    def kind(i: int) -> str:
        slides = config.sliding_window is not None and i not in config.full_attention_layers
        return "sliding_attention" if slides else "full_attention"

    return {
        "hidden_act": ACT,
        "hidden_activation": ACT,
        "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "layer_types": [kind(i) for i in range(config.num_layers)],
    }


FORMAT = decoder_format(
    "gemma2", "Gemma2ForCausalLM", extra=HFKeys(read=read_gemma, write=write_gemma), hidden_act=ACT
)
