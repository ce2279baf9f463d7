"""The model registry: family name -> `ModelSpec`, an explicit dict filled by `register_model`.

The built-in families are registered in `mindspeed_llm.models.__init__`; an embedder adds
its own with `register_model(ModelSpec(...))`, with its Hugging Face `config.json` format
(`ModelSpec.hf`) when it has one, so `TransformerConfig.from_hf` and `to_hf_dict` know it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models import hf_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer and tools need to know about one model family."""

    name: str
    """Family name, as in `TransformerConfig.family` and the `model.family` config field."""
    flavors: Mapping[str, TransformerConfig]
    """Named sizes; every family has a CPU-sized "debug"."""
    build: Callable[[TransformerConfig], nn.Module]
    """Config -> model (honours the ambient device, e.g. `with torch.device("meta")`)."""
    parallelize: Callable[..., nn.Module]
    """`parallelize(model, dims, *, ac_mode, param_dtype, reduce_dtype, sequence_parallel,
    loss_parallel, cp_mode, ulysses_degree)`: applies TP -> EP -> CP -> AC -> FSDP/DDP in
    place (see `models.common.parallelize_decoder`)."""
    hf_adapter: ModuleType | Any
    """Object with `to_hf(state_dict, config)` and `from_hf(hf_state_dict, config)`."""
    pipeline: Callable[..., Any] | None = None
    """`pipeline(model, dims, *, device, schedule, stages_per_rank, layers_per_stage,
    **parallelize_options)`: this rank's pipeline stages (a `PipelineParts`), each
    parallelised; None: the family does not support pipeline parallel."""
    hf: HFFormat | None = None
    """How the family's Hugging Face `config.json` reads and writes (its `hf.py`); None:
    no Hugging Face counterpart (`from_hf` / `to_hf_dict` refuse it)."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add `spec` under `spec.name` (and its Hugging Face format under its model_type).

    Raises:
        ValueError: a family of that name, or a format of that model_type, is already
            registered.
    """
    if spec.name in _REGISTRY:
        raise ValueError(f"model family {spec.name!r} is already registered")
    if spec.hf is not None:
        hf_format.add_format(spec.name, spec.hf)
    _REGISTRY[spec.name] = spec
    return spec


def unregister_model(family: str) -> None:
    """Remove `family` and its Hugging Face format (e.g. a plugin or a test that is done).

    Raises:
        ConfigError: no such family.
    """
    get_model_spec(family)
    hf_format.remove_format(family)
    del _REGISTRY[family]


def model_families() -> list[str]:
    """Names of the registered families, sorted."""
    return sorted(_REGISTRY)


def get_model_spec(family: str) -> ModelSpec:
    """The spec of `family`.

    Raises:
        ConfigError: unknown family (the message lists the known ones).
    """
    try:
        return _REGISTRY[family]
    except KeyError:
        raise ConfigError(
            f"unknown model family {family!r}; known: {', '.join(model_families())}"
        ) from None


def build_model_config(
    family: str,
    flavor: str | None = None,
    hf_config: str | Path | dict[str, Any] | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """A fresh config from a named flavor or from a Hugging Face config (exactly one).

    Args:
        family: registered family name.
        flavor: one of the family's flavors, e.g. "debug".
        hf_config: a Hugging Face `config.json` path, its directory, or its dict; its
            model_type must belong to `family`.
        overrides: fields of `TransformerConfig` to change (e.g. `ops_impl="reference"`).

    Raises:
        ConfigError: unknown family or flavor, both or neither source, a mismatched
            model_type, or an invalid field.
    """
    spec = get_model_spec(family)
    if (flavor is None) == (hf_config is None):
        raise ConfigError("give exactly one of flavor= or hf_config= to build a model config")
    if hf_config is not None:
        config = TransformerConfig.from_hf(hf_config, **overrides)
        if config.family != family:
            raise ConfigError(f"Hugging Face config is a {config.family!r} model, not {family!r}")
        return config
    if flavor not in spec.flavors:
        raise ConfigError(
            f"unknown flavor {flavor!r} of {family!r}; known: {', '.join(sorted(spec.flavors))}"
        )
    return dataclasses.replace(spec.flavors[flavor], **overrides)
