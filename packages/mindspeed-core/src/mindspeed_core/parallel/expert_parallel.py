"""Expert parallel: experts spread over the `ep` mesh, tokens exchanged by all-to-all.

An *experts module* is any module whose parameters stack the experts on dim 0 and whose
forward is ``forward(x, num_tokens_per_expert)`` with the rows of `x` sorted by expert
(mindspeed_llm's `GroupedExperts`). `apply_ep` shards those parameters on dim 0 over
`ep` (DTensor `Shard(0)`: rank r holds experts [r * E / ep, (r + 1) * E / ep)) and wraps
the forward, as torchtitan does, with two hooks:

- dispatch (before): exchange the token counts, then send each rank the rows of its
  experts (`all_to_all_single`), and sort the received rows by local expert;
- combine (after): undo the sort and send every row back to the rank it came from.

Both all-to-alls are differentiable (`all_to_all` below), so backward runs the reverse
exchanges. The other dispatcher, `AllGatherExpertParallel` (``dispatcher="allgather"``),
trades bandwidth for simplicity: every rank gathers all ranks' rows, runs the rows of its
own experts, and the results are summed back to the rank each row came from. Data parallel of the experts is `apply_expert_fsdp`: FSDP over
`dp_shard_mod_ep` (the data-parallel ranks that hold the same experts), gradients divided
by the whole data-parallel size, since every rank's loss reached every expert.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.utils.weak import WeakIdKeyDictionary

from mindspeed_core.errors import ParallelError


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Rows `input_splits[r]` of `x` go to rank r; returns the rows received (autograd)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallel:
    """The dispatch/combine hooks of one experts module over `ep_mesh`."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self._pending: tuple[Tensor, list[int], list[int]] | None = None

    def apply(self, module: nn.Module) -> nn.Module:
        return distribute_module(module, self.mesh, self._partition, self._dispatch, self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            # keep a frozen base frozen (LoRA on experts: only the adapters train)
            sharded = nn.Parameter(sharded, requires_grad=param.requires_grad)
            module.register_parameter(param_name, sharded)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs  # rows sorted by global expert; counts (num_experts,)
        ep = mesh.size()
        num_local = counts.numel() // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, num_local)  # [source rank, local expert]
        input_splits = counts.view(ep, num_local).sum(dim=1).tolist()
        output_splits = received.sum(dim=1).tolist()
        x = all_to_all(x, output_splits, input_splits, self.group)
        # Received rows come in (source, local expert) blocks; group them by expert.
        expert_of_row = torch.arange(num_local, device=x.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(received.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        self._pending = (order, input_splits, output_splits)
        return x[order], received.sum(dim=0)

    def _combine(self, module: nn.Module, y: Tensor, mesh: DeviceMesh) -> Tensor:
        assert self._pending is not None, "combine without dispatch"
        order, input_splits, output_splits = self._pending
        self._pending = None
        y = y[torch.argsort(order)]  # back to (source, local expert) blocks
        return all_to_all(y, input_splits, output_splits, self.group)


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order (`sizes[r]` rows from rank r);
    backward sums each rank's rows' gradients back to it."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.args = (sizes, rank, group)
        return gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _ScatterRows.apply(grad, *ctx.args), None, None, None


class _ScatterRows(torch.autograd.Function):
    """Rows of every rank for every rank, summed over ranks; rank r keeps its `sizes[r]`
    rows (a reduce-scatter with uneven blocks); backward gathers the gradients."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.args = (sizes, rank, group)
        total = x.contiguous().clone()
        # gloo has no reduce-scatter of uneven blocks: sum everything, keep our block.
        dist.all_reduce(total, group=group)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        return _GatherRows.apply(grad, *ctx.args), None, None, None


def gather_rows(x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    """All ranks' rows of `x` in rank order, rank r giving `sizes[r]` (no autograd)."""
    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    blocks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([b[:n] for b, n in zip(blocks, sizes, strict=True)])


class AllGatherExpertParallel(ExpertParallel):
    """The all-gather dispatcher: gather every rank's rows and counts, run the rows of
    this rank's experts, sum the results back to their ranks (differentiable both ways).

    Moves ep times the rows of all-to-all, with no uneven all-to-all: a fallback where
    that collective is slow or missing, and the reference the all-to-all is tested against.
    """

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs  # rows sorted by global expert; counts (num_experts,)
        ep, rank = mesh.size(), mesh.get_local_rank()
        num_local = counts.numel() // ep
        every = [torch.empty_like(counts) for _ in range(ep)]
        dist.all_gather(every, counts, group=self.group)
        every = torch.stack(every)  # (source rank, global expert)
        sizes = every.sum(dim=1).tolist()
        rows = _GatherRows.apply(x, sizes, rank, self.group)
        expert_of_row = torch.arange(counts.numel(), device=x.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(every.flatten())
        mine = torch.nonzero(expert_of_row // num_local == rank).squeeze(1)
        # rows of our experts, grouped by expert (each source's rows in order)
        mine = mine[torch.argsort(expert_of_row[mine], stable=True)]
        self._pending = (mine, sizes, rows.shape[0])
        local = every[:, rank * num_local : (rank + 1) * num_local].sum(dim=0)
        return rows[mine], local

    def _combine(self, module: nn.Module, y: Tensor, mesh: DeviceMesh) -> Tensor:
        assert self._pending is not None, "combine without dispatch"
        mine, sizes, num_rows = self._pending
        self._pending = None
        out = y.new_zeros((num_rows, *y.shape[1:])).index_copy(0, mine, y)
        return _ScatterRows.apply(out, sizes, mesh.get_local_rank(), self.group)


EP_DISPATCHERS = {"alltoall": ExpertParallel, "allgather": AllGatherExpertParallel}


def apply_ep(
    experts: Iterable[nn.Module], ep_mesh: DeviceMesh | None, *, dispatcher: str = "alltoall"
) -> None:
    """Shard each experts module over `ep_mesh` and route its tokens between the ranks.

    Apply after tensor parallel and before activation checkpointing and FSDP. None (ep=1)
    is a no-op.

    Args:
        dispatcher: "alltoall" (each row sent only to its expert's rank) or "allgather"
            (every rank sees every row; `AllGatherExpertParallel`).

    Raises:
        ParallelError: the number of experts is not divisible by the ep degree, or an
            unknown dispatcher.
    """
    if dispatcher not in EP_DISPATCHERS:
        raise ParallelError(f"ep_dispatcher={dispatcher!r}; choose one of {list(EP_DISPATCHERS)}")
    if ep_mesh is None:
        return
    for module in experts:
        for name, param in module.named_parameters(recurse=False):
            if param.shape[0] % ep_mesh.size():
                raise ParallelError(
                    f"ep={ep_mesh.size()} must divide the number of experts "
                    f"({param.shape[0]}, dim 0 of {name})"
                )
        EP_DISPATCHERS[dispatcher](ep_mesh).apply(module)


def apply_expert_fsdp(
    experts: Iterable[nn.Module],
    dp_mesh: DeviceMesh | None,
    *,
    grad_divide_factor: int,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> set[nn.Parameter]:
    """Data parallel of expert-parallel experts; returns parameters the outer FSDP must ignore.

    Args:
        dp_mesh: ``dims.mesh("dp_shard_mod_ep")``: ranks holding the same experts; None
            when every rank of the data-parallel group holds different experts.
        grad_divide_factor: the data-parallel size the dense gradients are averaged over
            (``dims.degree("dp_shard_cp")``): an expert's gradient sums every rank's loss.

    Without `dp_mesh` the experts are left out of FSDP (the returned set) and their
    gradients are divided by `grad_divide_factor` in hooks on the parameters, registered at
    the module's first forward (so they hold for parameters `to_empty` replaced after a
    model built on the meta device was materialised).
    """
    ignored: set[nn.Parameter] = set()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in experts:
        if dp_mesh is not None:
            fully_shard(module, mesh=dp_mesh, mp_policy=policy)
            module.set_gradient_divide_factor(float(grad_divide_factor))
            # A custom factor otherwise needs ReduceOp.PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
            continue
        module.register_forward_pre_hook(_GradDivide(grad_divide_factor))
        ignored.update(module.parameters())
    return ignored


class _GradDivide:
    """Forward pre-hook: divides the gradient of each trainable parameter of the module by
    `factor`, with a tensor hook registered once per parameter object."""

    def __init__(self, factor: int):
        self.factor = factor
        self.seen = WeakIdKeyDictionary()  # parameter -> True (tensors compare by value)

    def __call__(self, module: nn.Module, args) -> None:
        for param in module.parameters():
            if param.requires_grad and param not in self.seen:  # a frozen base: no grad
                param.register_hook(lambda grad, f=self.factor: grad / f)
                self.seen[param] = True
