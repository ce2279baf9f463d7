"""Collectives of context parallel: Ulysses all-to-all (differentiable) and the ring shift.

The all-to-alls are autograd Functions whose backward is the inverse all-to-all; the ring
shift is used inside the ring attention Function, whose backward sends dK/dV round the ring
itself. Plain torch.distributed calls, so they run on gloo, NCCL and HCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def _seq_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """(tokens, heads, d) on each rank -> (size * tokens, heads / size, d)."""
    size = dist.get_world_size(group)
    tokens, heads, dim = x.shape
    send = x.reshape(tokens, size, heads // size, dim).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # recv[j]: rank j's tokens, this rank's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(size * tokens, heads // size, dim)


def _heads_to_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    """The inverse: (size * tokens, heads / size, d) -> (tokens, heads, d)."""
    size = dist.get_world_size(group)
    all_tokens, local_heads, dim = x.shape
    send = x.reshape(size, all_tokens // size, local_heads, dim).contiguous()
    recv = torch.empty_like(send)  # recv[j]: this rank's tokens, rank j's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(all_tokens // size, size * local_heads, dim)


class SeqToHeads(torch.autograd.Function):
    """Ulysses: trade the sequence shard for a head shard (backward: the inverse)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Ulysses: back from a head shard to the sequence shard (backward: the inverse)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def start_shift_many(
    tensors: tuple[Tensor, ...], group: ProcessGroup, step: int = 1
) -> tuple[tuple[Tensor, ...], list]:
    """Start sending each tensor to the rank `step` places on and receiving its counterpart
    from the rank `step` places back (one batch of p2p ops); returns the receive buffers and
    the requests to wait on (`wait_many`)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + step) % size)
    source = dist.get_global_rank(group, (rank - step) % size)
    ops, received = [], []
    for t in tensors:
        t, recv = t.contiguous(), torch.empty_like(t)
        ops += [dist.P2POp(dist.isend, t, to, group), dist.P2POp(dist.irecv, recv, source, group)]
        received.append(recv)
    return tuple(received), dist.batch_isend_irecv(ops)


def wait_many(pending: tuple[tuple[Tensor, ...], list]) -> tuple[Tensor, ...]:
    """The buffers of a `start_shift_many`, once they arrived."""
    received, requests = pending
    for request in requests:
        request.wait()
    return received


def shift_many(tensors: tuple[Tensor, ...], group: ProcessGroup, step: int = 1):
    """`start_shift_many` and wait for it."""
    return wait_many(start_shift_many(tensors, group, step))
