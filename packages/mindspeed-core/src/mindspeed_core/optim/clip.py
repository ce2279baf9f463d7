"""Gradient-norm clipping across DTensor shards and pipeline stages.

The norm of a sharded gradient is computed on each shard and reduced over the
shard's mesh (DTensor does that in `full_tensor()`); gradients that live on
different meshes (dense and expert weights, say) are reduced group by group and
combined; with pipeline parallel each rank holds only its stages' gradients, so
the per-stage norms are combined over the pipeline mesh last. A weight held by two
stages (tied embeddings) counts once: the other copy is passed as `exclude`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mindspeed_core.parallel import dtensor


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
    exclude: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """The norm of all gradients of `parameters` over every rank that holds a piece,
    those of `exclude` (copies of a weight another stage counts) left out."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    excluded = {id(p) for p in exclude}
    for p in parameters:
        if p.grad is not None and id(p) not in excluded:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups[key].append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        norms.append(dtensor.full(norm))  # reduces partial norms over the shard mesh
    if norms:
        total = torch.nn.utils.get_total_norm(norms, norm_type)
    else:  # a rank without gradients still joins the pipeline reduction below
        total = torch.zeros((), device=_device_of(pp_mesh))
    if pp_mesh is not None:
        total = _reduce_over(total, norm_type, pp_mesh)
    return total


def _reduce_over(norm: torch.Tensor, norm_type: float, mesh: DeviceMesh) -> torch.Tensor:
    group = mesh.get_group()
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
    exclude: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before.

    A `max_norm` of 0 or less only measures the norm. `exclude`: parameters scaled but
    left out of the norm (the last stage's copy of a tied embedding).
    """
    parameters = list(parameters)
    norm = total_grad_norm(parameters, norm_type, pp_mesh=pp_mesh, foreach=foreach, exclude=exclude)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        # Scale each rank's own shard: the same as scaling the whole gradient.
        grads = [dtensor.local(p.grad) for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


def _device_of(mesh: DeviceMesh | None) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )
