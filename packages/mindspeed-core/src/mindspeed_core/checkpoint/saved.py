"""Parameters that checkpoints hold differently from the model: padding rows left out,
a copy of one weight saved under that weight's name.

A model may hold a parameter with padding rows (a vocabulary padded so that tensor
parallel divides it, Megatron's `--make-vocab-size-divisible-by`) or hold one weight
twice (tied embeddings under pipeline parallel: the first and the last stage each keep
a copy). Its checkpoints show neither: they keep the real rows, and the optimizer state
of the copy under the weight's own name (`optimizer_only`: the model state names both,
as one process's tied model does), so a checkpoint does not depend on the layout it was
saved from. A model says so with a method::

    def saved_params(self) -> dict[str, SavedParam]:   # parameter name -> how it is saved

`ModelState` and `OptimizersContainer` apply it to the model's and the optimizer's
state (`saved_state` on the way out, `restored_state` on the way in); a module without
the method is saved as it is.

Stripping gathers a sharded parameter (DTensor) whole on every rank before it cuts the
padding off, so a padded parameter costs one all-gather per save and per load (the
saved tensor is then a plain replicated one, which DCP writes once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

KeySplit = Callable[[str], tuple[str, str, str]]
"""A state key -> (prefix, parameter name, suffix)."""


@dataclass(frozen=True)
class SavedParam:
    """How one parameter appears in checkpoints."""

    name: str
    """Its name there (another parameter's name for a copy of that one)."""
    rows: int | None = None
    """Leading rows saved (the rest is padding, zero on load); None: all."""
    optimizer_only: bool = False
    """Rename only in the optimizer's state (a copy the model state names as itself,
    e.g. the last stage's output projection of tied embeddings)."""


def saved_params(module: nn.Module, *, optimizer: bool = False) -> dict[str, SavedParam]:
    """What `module.saved_params()` declares for the model's state, or with `optimizer`
    for the optimizer's (empty when it has no such method)."""
    method = getattr(module, "saved_params", None)
    params = dict(method()) if callable(method) else {}
    if optimizer:
        return params
    return {n: p for n, p in params.items() if not p.optimizer_only}


def strip_rows(tensor: Tensor, rows: int | None) -> Tensor:
    """The first `rows` rows of `tensor`, a DTensor gathered whole first (a view for a
    plain tensor, so a checkpoint loaded into it lands in the tensor itself)."""
    if rows is None or tensor.dim() == 0 or tensor.shape[0] == rows:
        return tensor
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach()[:rows]


def pad_rows(saved: Tensor, like: Tensor) -> Tensor:
    """`saved` with zero rows appended up to `like`'s shape, laid out as `like` (this
    rank's shard of a DTensor with `like`'s mesh and placements, or a plain tensor)."""
    saved = saved.full_tensor() if isinstance(saved, DTensor) else saved
    whole = saved.new_zeros(like.shape)
    whole[: saved.shape[0]] = saved
    if not isinstance(like, DTensor):
        return whole.to(like.device)
    (chunk,) = like.__create_chunk_list__()  # this rank's block of the global tensor
    local = whole
    for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        local = local.narrow(dim, start, size)
    return DTensor.from_local(
        local.contiguous().to(like.to_local().device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def saved_state(
    state: Mapping[str, Any], params: Mapping[str, SavedParam], split: KeySplit | None = None
) -> dict[str, Any]:
    """`state` (keyed by parameter name, or by `split(key)` -> (prefix, name, suffix))
    under the saved names, padding cut off; the first of several copies wins."""
    split = split or _plain_key
    out: dict[str, Any] = {}
    for key, value in state.items():
        prefix, name, suffix = split(key)
        saved = params.get(name)
        if saved is None:
            out.setdefault(key, value)
            continue
        if isinstance(value, Tensor):
            value = strip_rows(value, saved.rows)
        out.setdefault(prefix + saved.name + suffix, value)
    return out


def restored_state(
    state: Mapping[str, Any],
    params: Mapping[str, SavedParam],
    like: Mapping[str, Tensor],
    split: KeySplit | None = None,
) -> dict[str, Any]:
    """The inverse of `saved_state` for the parameters in `like` (name -> the model's
    parameter, whose shape and layout padded tensors take)."""
    split = split or _plain_key
    by_saved: dict[str, list[str]] = {}
    for name, saved in params.items():
        if name in like:
            by_saved.setdefault(saved.name, []).append(name)
    out = {}
    for key, value in state.items():
        prefix, name, suffix = split(key)
        if name not in by_saved or (name in like and name not in params):
            out[key] = value  # not a saved name, or also a parameter saved as itself
        for target in by_saved.get(name, ()):
            if isinstance(value, Tensor) and value.dim() > 0:
                restored = pad_rows(value, like[target]) if params[target].rows else value
            else:
                restored = value
            out[prefix + target + suffix] = restored
    return out


def _plain_key(key: str) -> tuple[str, str, str]:
    return "", key, ""


def optimizer_key(key: str) -> tuple[str, str, str]:
    """A flattened optimizer state key `state.<param>.exp_avg` -> its three parts."""
    kind, _, rest = key.partition(".")
    name, _, leaf = rest.rpartition(".")
    return kind + ".", name, "." + leaf


def param_like(module: nn.Module) -> dict[str, Tensor]:
    """Parameter name -> parameter, every name of a shared one."""
    return dict(module.named_parameters(remove_duplicate=False))
