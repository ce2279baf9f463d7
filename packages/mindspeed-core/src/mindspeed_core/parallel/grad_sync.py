"""Tied weights across pipeline stages (Megatron's embedding group and
`_allreduce_embedding_grads`).

With tied embeddings under pipeline parallel the first stage (embedding) and the last
stage (output projection) each hold a copy of one weight. `TiedGrads` sums the two
copies' gradients after backward, so both take the same optimizer step and stay equal
(they start equal: `split_pipeline(..., tied=True)` copies one initialised model);
`exclude` names the last stage's copy, which the gradient norm leaves out to count the
weight once (`clip_grad_norm_(..., exclude=...)`).

The sums act on this rank's shards (FSDP/TP): the ranks of the group shard both copies
alike. Call it once per optimizer step, after backward and before clipping; every rank
calls it, also ranks that hold neither end (they do nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mindspeed_core.parallel.dims import ParallelDims
from mindspeed_core.parallel.dtensor import local


class TiedGrads:
    """Sum the gradients of the copies `first` (first stage) and `last` (last stage) of
    one weight; None where this rank holds no such stage. `group` joins this rank with
    the rank of the other end (`pipeline_ends_group`)."""

    def __init__(
        self,
        first: nn.Parameter | None,
        last: nn.Parameter | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.first, self.last, self.group = first, last, group
        self.exclude: list[nn.Parameter] = [] if last is None else [last]
        """Parameters the gradient norm must leave out (the last stage's copy)."""

    @torch.no_grad()
    def __call__(self) -> None:
        copies = [p for p in (self.first, self.last) if p is not None]
        for p in copies:
            if p.grad is None:  # a rank must join the sum even without a gradient
                p.grad = torch.zeros_like(p)
            elif isinstance(p, DTensor) and p.grad.placements != p.placements:
                # an embedding's gradient may come out replicated: shard it as the weight
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local(p.grad) for p in copies]
        if len(grads) == 2:  # both ends on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads and self.group is not None:
            dist.all_reduce(grads[0], group=self.group)


def pipeline_ends_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group of this rank's first and last pipeline rank (Megatron's embedding group):
    the pipeline group itself for pp=2, a group of two for pp > 2 (None on the ranks in
    between), None for pp=1. Collective: every rank calls it."""
    if dims.pp == 1:
        return None
    if dims.pp == 2:
        return dims.mesh("pp").get_group()
    ranks = dims.world_mesh.mesh.reshape(dims.pp, -1).t().tolist()  # pp is the outer axis
    group, _ = dist.new_subgroups_by_enumeration([[row[0], row[-1]] for row in ranks])
    return group
