"""Gemma 3 text in Hugging Face's spelling (`gemma3_text`): Gemma 2's keys, always q/k
norms, and two RoPEs: transformers v5 nests them in `rope_parameters` by layer type, v4
writes `rope_theta` + `rope_scaling` (full blocks) and `rope_local_base_freq` (windowed
blocks). We write v4's keys."""

from __future__ import annotations

from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common.hf_config import HFKeys, _read_rope, decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.gemma2 import hf as gemma2


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    fields = gemma2.read_gemma(hf)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = _read_rope({**hf, "rope_parameters": params.get("full_attention")})
        local, local_scaling = _read_rope({**hf, "rope_parameters": params["sliding_attention"]})
    else:
        theta, scaling = _read_rope(hf)
        local, local_scaling = hf.get("rope_local_base_freq", 10000.0), None
    if local_scaling is not None:
        raise ConfigError("RoPE scaling of the sliding-window layers is not supported")
    return {
        **fields,
        "qk_norm": True,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "local_rope_theta": local,
    }


def _write(config: TransformerConfig) -> dict[str, Any]:
    return {**gemma2.write_gemma(config), "rope_local_base_freq": config.local_rope_theta}


FORMAT = decoder_format(
    "gemma3_text",
    "Gemma3ForCausalLM",
    extra=HFKeys(read=_read, write=_write),
    hidden_act=gemma2.ACT,
)
