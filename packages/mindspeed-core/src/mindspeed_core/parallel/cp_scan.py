"""Recurrent token mixers under context parallel: the state passed along the zig-zag chunks.

Rank r of a cp group holds chunks r and 2cp-1-r of every row (`shard_sequence`). A recurrent
mixer (gated DeltaNet, a short convolution, Mamba) needs each chunk's state after all earlier
chunks, so `chunk_scan` runs the chunks in sequence order: chunk c gets its state from the
owner of chunk c-1 (rank c-1 for c < cp, then back down the ranks), and in backward each
chunk's state gradient goes back the same way. The mixer's own work stays on the rank that
holds the tokens (memory scales with 1/cp); the chunks run one after another (time does not).

`fn(inputs, params, state) -> (outputs, new_state)` is the mixer on one chunk: token-major
inputs (batch, chunk, ...), explicit parameter tensors (their gradients summed over the
chunks), and the state tensors (shaped like `init_state`). Plain point-to-point calls, so it
runs on gloo, NCCL and HCCL alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

ChunkFn = Callable[[list[Tensor], list[Tensor], list[Tensor]], tuple[list[Tensor], list[Tensor]]]


def chunk_scan(
    fn: ChunkFn,
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    init_state: Sequence[Tensor],
    group: ProcessGroup,
) -> list[Tensor]:
    """`fn` over this rank's two zig-zag chunks with the state of every earlier chunk.

    Args:
        inputs: (batch, local_seq, ...) tensors: this rank's two chunks, one after the other.
        params: tensors `fn` uses whole for every chunk (e.g. a convolution weight).
        init_state: the state before the first chunk (zeros); also the shapes and dtypes of
            the state sent between ranks.
        group: the cp ranks.

    Returns the outputs of `fn`, the two chunks' concatenated along dim 1.
    """
    n_in, n_par = len(inputs), len(params)
    return list(_ChunkScan.apply(fn, group, n_in, n_par, *inputs, *params, *init_state))


def _peer(group: ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def _send(tensors: Sequence[Tensor], rank: int, group: ProcessGroup) -> None:
    for t in tensors:
        dist.send(t.detach().contiguous(), _peer(group, rank), group=group)


def _recv(templates: Sequence[Tensor], rank: int, group: ProcessGroup) -> list[Tensor]:
    out = []
    for t in templates:
        buffer = torch.empty_like(t)
        dist.recv(buffer, _peer(group, rank), group=group)
        out.append(buffer)
    return out


class _Chunk:
    """One chunk's forward, kept with its graph for the backward."""

    def __init__(self, fn: ChunkFn, inputs, params, state):
        with torch.enable_grad():
            self.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            self.params = [p.detach().requires_grad_(p.requires_grad) for p in params]
            self.state = [s.detach().requires_grad_(s.is_floating_point()) for s in state]
            self.outputs, self.new_state = fn(self.inputs, self.params, self.state)

    def grads(self, d_outputs, d_state):
        """(input grads, param grads, state grads) from the outputs' and new state's."""
        pairs = [(o, g) for o, g in zip([*self.outputs, *self.new_state], [*d_outputs, *d_state],
                                        strict=True) if o.requires_grad and g is not None]  # fmt: skip
        leaves = [*self.inputs, *self.params, *self.state]
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True) if pairs else [None] * len(wanted))  # fmt: skip
        grads = [next(got) if t.requires_grad else None for t in leaves]
        grads = [torch.zeros_like(t) if g is None and t.requires_grad else g
                 for g, t in zip(grads, leaves, strict=True)]  # fmt: skip
        n_in, n_par = len(self.inputs), len(self.params)
        return grads[:n_in], grads[n_in : n_in + n_par], grads[n_in + n_par :]


class _ChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, group, n_in, n_par, *tensors):
        inputs, params = tensors[:n_in], tensors[n_in : n_in + n_par]
        init = tensors[n_in + n_par :]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        halves = [[t.chunk(2, dim=1)[h] for t in inputs] for h in (0, 1)]
        state = list(init) if rank == 0 else _recv(init, rank - 1, group)
        first = _Chunk(fn, halves[0], params, state)
        if rank < size - 1:
            _send(first.new_state, rank + 1, group)
            state = _recv(init, rank + 1, group)
        else:  # the middle of the sequence: this rank's own second chunk comes next
            state = [s.detach() for s in first.new_state]
        second = _Chunk(fn, halves[1], params, state)
        if rank > 0:
            _send(second.new_state, rank - 1, group)
        ctx.chunks, ctx.group, ctx.init = (first, second), group, [t.detach() for t in init]
        ctx.n_params = n_par
        return tuple(
            torch.cat([a.detach(), b.detach()], dim=1)
            for a, b in zip(first.outputs, second.outputs, strict=True)
        )

    @staticmethod
    def backward(ctx, *d_outputs):
        first, second = ctx.chunks
        group, rank = ctx.group, dist.get_rank(ctx.group)
        size = dist.get_world_size(group)
        halves = [
            [None if g is None else g.chunk(2, dim=1)[h].contiguous() for g in d_outputs]
            for h in (0, 1)
        ]
        # the second chunk: its new state went down to rank - 1 (none after the last chunk)
        d_state = [None] * len(ctx.init) if rank == 0 else _recv(ctx.init, rank - 1, group)
        d_in2, d_par2, d_state2 = second.grads(halves[1], d_state)
        if rank < size - 1:
            _send([_zero_if_none(g, t) for g, t in zip(d_state2, ctx.init, strict=True)],
                  rank + 1, group)  # fmt: skip
            d_state = _recv(ctx.init, rank + 1, group)
        else:
            d_state = d_state2
        d_in1, d_par1, d_state1 = first.grads(halves[0], d_state)
        if rank > 0:
            _send([_zero_if_none(g, t) for g, t in zip(d_state1, ctx.init, strict=True)],
                  rank - 1, group)  # fmt: skip
        d_inputs = [
            None if a is None else torch.cat([a, b], dim=1)
            for a, b in zip(d_in1, d_in2, strict=True)
        ]
        d_params = [
            None if a is None else a + b for a, b in zip(d_par1, d_par2, strict=True)
        ]
        return (None, None, None, None, *d_inputs, *d_params, *([None] * len(ctx.init)))


def _zero_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad
