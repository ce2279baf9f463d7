"""How each family spells its config in Hugging Face's `config.json`, looked up by
`model_type` (reading) or by family (writing).

A family's `HFFormat` comes with its `ModelSpec` (`ModelSpec.hf`) and is added here by
`register_model`; `TransformerConfig.from_hf` and `to_hf_dict` look it up. The built-in
families build theirs with `mindspeed_llm.models.common.hf_config.decoder_format`; a
family with other keys writes its own `read` and `write`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mindspeed_core.errors import ConfigError

if TYPE_CHECKING:
    from mindspeed_llm.models.config import TransformerConfig


@dataclass(frozen=True, kw_only=True)
class HFFormat:
    """One family's translation to and from a Hugging Face `config.json`."""

    model_type: str
    """The `model_type` transformers gives the family, e.g. "qwen2_moe"."""
    architecture: str
    """The causal-LM class transformers builds, e.g. "Qwen2MoeForCausalLM"."""
    read: Callable[[dict[str, Any]], dict[str, Any]]
    """config.json dict -> `TransformerConfig` fields (all but `family`); raises
    `ConfigError` for what the model cannot build."""
    write: Callable[[TransformerConfig], dict[str, Any]]
    """Our config -> config.json keys (all but `model_type` and `architectures`)."""


_BY_MODEL_TYPE: dict[str, tuple[str, HFFormat]] = {}
_BY_FAMILY: dict[str, HFFormat] = {}


def add_format(family: str, hf: HFFormat) -> None:
    """Make `family` readable from and writable to config.json (`register_model` calls it).

    Raises:
        ValueError: its model_type already belongs to another family.
    """
    if hf.model_type in _BY_MODEL_TYPE:
        owner = _BY_MODEL_TYPE[hf.model_type][0]
        raise ValueError(f"Hugging Face model_type {hf.model_type!r} already belongs to {owner!r}")
    _BY_MODEL_TYPE[hf.model_type] = (family, hf)
    _BY_FAMILY[family] = hf


def remove_format(family: str) -> None:
    """Forget `family`'s format (nothing happens when it has none)."""
    hf = _BY_FAMILY.pop(family, None)
    if hf is not None:
        del _BY_MODEL_TYPE[hf.model_type]


def model_types() -> list[str]:
    """The Hugging Face model types we read, sorted."""
    return sorted(_BY_MODEL_TYPE)


def format_of_model_type(model_type: Any) -> tuple[str, HFFormat]:
    """(family, format) of a config.json's `model_type`.

    Raises:
        ConfigError: no registered family has that model type (the message lists them).
    """
    if not isinstance(model_type, str) or model_type not in _BY_MODEL_TYPE:
        raise ConfigError(
            f"Hugging Face model_type={model_type!r} is not supported; "
            f"known: {', '.join(model_types())}"
        )
    return _BY_MODEL_TYPE[model_type]


def format_of_family(family: str) -> HFFormat:
    """The format of `family`.

    Raises:
        ConfigError: the family has no Hugging Face format.
    """
    if family not in _BY_FAMILY:
        raise ConfigError(f"model family {family!r} has no Hugging Face config format")
    return _BY_FAMILY[family]
