"""Start a model without ever holding more than this rank's shards plus one tensor.

Every command builds its model the same way (torchtitan's order, our initial values):

    model = build_meta(config)                    # no storage
    weights = check_hf_weights(model, path, cfg)  # headers only: shapes checked up front
    base = base_shapes(model)                     # what a checkpoint of this model fills
    parallelize(model, dims)  /  pipeline split   # DTensors and stages, still on meta
    fill_parts(parts, device, seed=..., weights=weights, base=base)

`fill_parts` gives each part its storage on the device (`to_empty`: the shards this rank
holds), reads this rank's block of every tensor the checkpoint has (`read_hf_weights`)
and draws the rest (adapters, a swapped head, or all of it without a checkpoint) from the
run's seed by name (`Transformer.init_weights`), so every layout starts from one
process's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from mindspeed_core.parallel.materialize import materialize, plain_name, run_materialized_hooks
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_io import HFWeights, check_hf_weights, read_hf_weights
from mindspeed_llm.models.registry import get_model_spec

__all__ = ["base_shapes", "build_meta", "build_whole", "fill_parts"]

Shapes = Mapping[str, tuple[int, ...]]


def build_meta(config: TransformerConfig) -> nn.Module:
    """The family's model for `config` on the meta device (no storage, nothing drawn)."""
    with torch.device("meta"):
        return get_model_spec(config.family).build(config)


def build_whole(
    config: TransformerConfig,
    device: torch.device | str,
    *,
    seed: int,
    hf_path: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """One process's whole model on `device`: `hf_path`'s weights, or drawn from `seed` (the
    values every layout of `train.build.build_model` starts from).

    Raises:
        CheckpointError: `hf_path` does not fit `config`.
    """
    model = build_meta(config)
    weights = None if hf_path is None else check_hf_weights(model, hf_path, config)
    fill_parts([model], device, seed=seed, weights=weights, base=base_shapes(model), dtype=dtype)
    return model


def base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of plain `model` holds (before a hook
    swaps a head or adds adapters, before tensor parallel pads the vocabulary)."""
    return {plain_name(n): tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}


def fill_parts(
    parts: Sequence[nn.Module],
    device: torch.device | str,
    *,
    seed: int,
    weights: HFWeights | None = None,
    base: Shapes | None = None,
    dtype: torch.dtype | None = None,
) -> set[str]:
    """Materialise `parts` (built on meta, parallelised) on `device` and fill them: the
    tensors `weights` holds from it (this rank's blocks), the others drawn from `seed`.

    Args:
        weights: a Hugging Face folder checked against the plain model; None: draw all.
        base: `base_shapes` of the plain model: a tensor is read only when it is still the
            one the checkpoint holds (a swapped head of another shape is drawn).
        dtype: cast floating-point parameters first (inference in bf16).

    Returns:
        The names read from `weights`.
    """
    read: set[str] = set()
    for part in parts:
        materialize(part, device, dtype=dtype)
        names = _from_checkpoint(part, weights, base)
        part.init_weights(buffer_device=torch.device(device), seed=seed, skip=names)
        if weights is not None:
            read |= read_hf_weights([part], weights, names)
        run_materialized_hooks(part)
    return read


def _from_checkpoint(
    part: nn.Module, weights: HFWeights | None, base: Shapes | None
) -> set[str]:
    """The names of `part` that `weights` fills: those of the plain model that kept their
    shape (up to padding rows)."""
    if weights is None:
        return set()
    names = set()
    for name, tensor in part.state_dict(keep_vars=True).items():
        name = plain_name(name)
        want = None if base is None else base.get(name)
        if name not in weights.shapes or (base is not None and want is None):
            continue
        shape = tuple(tensor.shape)
        if want is None or (shape[1:] == want[1:] and (not shape or shape[0] >= want[0])):
            names.add(name)
    return names
