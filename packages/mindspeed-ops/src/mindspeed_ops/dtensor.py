"""DTensor inputs for the row-wise ops (rms_norm, swiglu) under tensor/sequence parallel plans.

Both ops are independent per row (everything but the last dim), so a DTensor that does not
shard its last dim runs the op on its local shard and is wrapped back with the same placements.
A replicated parameter (the norm weight) is used locally; its gradient is marked Partial over
the mesh dims where the input is sharded, so DTensor sums the per-shard contributions, exactly
what `local_map` does. Partial inputs are reduced first (the ops are not linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def is_dtensor(t: object) -> bool:
    if not _DTENSOR:
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])


_DTENSOR: list[type] = []  # the DTensor class, imported on the first call (called per op)


def run_rowwise(
    op: str,
    fn: Callable[..., Tensor],
    x: Tensor,
    rows_like: tuple[Tensor | None, ...] = (),
    params: tuple[Tensor | None, ...] = (),
) -> Tensor:
    """fn(x_local, *rows_like_local, *params_local) wrapped back into a DTensor like x.

    Args:
        op: the op's name, for error messages.
        x: a DTensor whose last dim is not sharded.
        rows_like: further DTensor inputs laid out exactly like x (swiglu's second tensor).
        params: replicated parameters (DTensor, or None); plain tensors are refused.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if any(p.is_shard() and p.dim % x.ndim == x.ndim - 1 for p in x.placements):
        raise ValueError(f"{op}: x must not be sharded on its last dim, got {x.placements}")
    placements = tuple(Replicate() if p.is_partial() else p for p in x.placements)
    if placements != tuple(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    locals_ = [x.to_local()]
    for other in rows_like:
        if not is_dtensor(other):
            raise TypeError(f"{op}: every input must be a DTensor when x is one")
        if other.device_mesh != x.device_mesh or tuple(other.placements) != placements:
            other = other.redistribute(x.device_mesh, placements)
        locals_.append(other.to_local())
    param_grads = [Partial() if p.is_shard() else Replicate() for p in placements]
    for param in params:
        if param is None:
            locals_.append(None)
            continue
        if not is_dtensor(param):
            raise TypeError(f"{op}: parameters must be DTensors when x is one (got a Tensor)")
        replicated = [Replicate()] * x.device_mesh.ndim
        if tuple(param.placements) != tuple(replicated):
            param = param.redistribute(x.device_mesh, replicated)
        locals_.append(param.to_local(grad_placements=param_grads))
    out = fn(*locals_)
    shape = (*x.shape[:-1], out.shape[-1])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        out, x.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
