"""RMSNorm as a module over `mindspeed_ops.rms_norm`, also on sequence-sharded DTensors."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_ops import rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dimension.

    Under a sequence-parallel plan the input is a DTensor sharded along the sequence and the
    weight a replicated DTensor: the op runs on the local shard, and the weight's local
    gradient is marked Partial over the sharded mesh dims so DTensor sums it across ranks.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, impl: str = "auto", offset: bool = False):
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.offset = offset  # multiply by (1 + weight), weight initialised to 0 (Gemma)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)

    def init_params(self, init: ParamInit) -> None:
        init.constant(self.weight, 0.0 if self.offset else 1.0)

    def _scale(self, weight: Tensor) -> Tensor:
        return weight + 1 if self.offset else weight

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, DTensor):
            return self._forward_dtensor(x)
        weight = self.weight
        if isinstance(weight, DTensor):
            # A replicated weight over this rank's share of a tensor-parallel input (the local
            # heads of q/k): the local weight gradient is a partial sum over ranks.
            weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
        return rms_norm(x, self._scale(weight), self.eps, impl=self.impl)

    def _forward_dtensor(self, x: DTensor) -> DTensor:
        if any(p.is_shard(x.ndim - 1) or p.is_shard(-1) for p in x.placements):
            raise ValueError(f"RMSNorm input must not be sharded on its last dim: {x.placements}")
        if any(p.is_partial() for p in x.placements):  # the norm is not linear: reduce first
            x = x.redistribute(
                placements=[Replicate() if p.is_partial() else p for p in x.placements]
            )
        weight = self.weight
        if isinstance(weight, DTensor):
            grads = [Partial() if p.is_shard() else Replicate() for p in x.placements]
            weight = weight.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            weight = weight.to_local(grad_placements=grads)
        out = rms_norm(x.to_local(), self._scale(weight), self.eps, impl=self.impl)
        return DTensor.from_local(
            out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm_over_ranks(x: Tensor, norm: RMSNorm, group: dist.ProcessGroup) -> Tensor:
    """`norm` over a last dimension split across `group`'s ranks: each holds its columns of
    x and, as a Shard(0) DTensor, its slice of the weight (MiniMax-M2's q/k norm over all
    heads under tensor parallel). The squares are summed over the ranks (autograd: the
    sum's gradient is all-reduced back), so every rank divides by the whole width."""
    weight = norm.weight.to_local() if isinstance(norm.weight, DTensor) else norm.weight
    xf = x.float()
    squares = dist_nn.all_reduce(xf.pow(2).sum(-1, keepdim=True), group=group)
    width = x.shape[-1] * dist.get_world_size(group)
    y = xf * torch.rsqrt(squares / width + norm.eps)
    return (y * norm._scale(weight).float()).to(x.dtype)
