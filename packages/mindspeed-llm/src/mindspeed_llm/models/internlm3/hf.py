"""InternLM3 in Hugging Face's spelling: Llama's keys under model type `internlm3`; the
original remote-code config spells `attention_bias` / `mlp_bias` as `qkv_bias` / `bias`."""

from __future__ import annotations

from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common.hf_config import decoder_format
from mindspeed_llm.models.hf_format import HFFormat

_BASE = decoder_format("internlm3", "InternLM3ForCausalLM")


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    for key in ("qkv_bias", "bias"):
        if hf.get(key):
            raise ConfigError(f"internlm3 with {key}=true is not supported")
    return _BASE.read(hf)


FORMAT = HFFormat(model_type="internlm3", architecture=_BASE.architecture, read=_read, write=_BASE.write)
