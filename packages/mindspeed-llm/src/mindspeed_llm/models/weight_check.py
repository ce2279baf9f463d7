"""Check a checkpoint's tensors against the model its config describes, before copying any.

A checkpoint whose config.json says one thing and whose tensors say another (a weight of
the wrong shape, integer bytes where a float weight belongs) must be refused by name, not
converted or loaded into a model that then computes nonsense.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mindspeed_core.errors import CheckpointError

Shapes = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def model_shapes(config) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor of the model `config` builds (on meta)."""
    from mindspeed_llm.models.registry import get_model_spec

    with torch.device("meta"):
        model = get_model_spec(config.family).build(config)
    return {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}


def check_weights(
    source, found: Shapes, expected: Shapes, original_names: Mapping[str, str] | None = None
) -> None:
    """Every tensor in `found` has the shape `expected` says, and a float weight is stored
    as a float (not an integer or bool) tensor.

    Args:
        source: the file or folder the tensors come from (for the message).
        found: our name -> (dtype, shape) as stored.
        expected: our name -> (dtype, shape) of the model.
        original_names: our name -> the checkpoint's own name, to name both.

    Raises:
        CheckpointError: naming the tensor and both shapes (or both dtypes).
    """
    original_names = original_names or {}
    for name in sorted(found.keys() & expected.keys()):
        (stored_dtype, stored_shape), (want_dtype, want_shape) = found[name], expected[name]
        label = name if name not in original_names else f"{original_names[name]} (ours: {name})"
        if tuple(stored_shape) != tuple(want_shape):
            raise CheckpointError(
                f"{source}: tensor {label} has shape {tuple(stored_shape)} but the model its "
                f"config describes expects {tuple(want_shape)}"
            )
        if want_dtype.is_floating_point and not stored_dtype.is_floating_point:
            raise CheckpointError(
                f"{source}: tensor {label} is stored as {stored_dtype}, but it is a "
                f"floating-point weight ({want_dtype}) of shape {tuple(want_shape)}"
            )
