"""Zig-zag ring attention as one autograd Function: memory of the local K/V only.

Each rank holds, per document, zig-zag chunks r and 2R-1-r (its first and second half).
At ring step s the K/V of rank r-s visit; with the chunk order, the visit is one of:

- s = 0, its own K/V: causal over the local documents;
- source < r: its first chunk precedes both of ours and its second follows both, so all
  our queries see its first chunk, fully;
- source > r: both its chunks lie between ours, so only our second chunk sees them, fully.

Partial results merge through their log-sum-exp. Both passes prefetch the next K/V while
they compute. Backward sends the K/V round again with their dK/dV accumulators: each block
is recomputed by the injected kernel and differentiated with the gradient the merge gives
it (flash-attention style: a block's weight in the output is exp(lse_block - lse)), and
after the last step the accumulators take one more step home to their owner.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor

from mindspeed_core.parallel.cp_comm import shift, start_shift


def _halves(cu: list[int], device) -> tuple[Tensor, Tensor, Tensor]:
    """Token indices of the first and second half of every local document, and the
    boundaries of the halves (each half is one zig-zag chunk)."""
    first, second, bounds = [], [], [0]
    for a, b in pairwise(cu):
        half = (b - a) // 2
        first.append(torch.arange(a, a + half))
        second.append(torch.arange(a + half, b))
        bounds.append(bounds[-1] + half)
    as_tensor = torch.tensor(bounds, dtype=torch.int32, device=device)
    return torch.cat(first).to(device), torch.cat(second).to(device), as_tensor


def _blocks(step: int, source: int, rank: int, layout) -> Iterator[tuple]:
    """(query rows, key rows, causal, cu_seqlens) of each attention call at `step`;
    None rows mean all of them."""
    first, second, cu_local, cu_half = layout
    if step == 0:
        yield None, None, True, cu_local
    elif source < rank:
        yield first, first, False, cu_half
        yield second, first, False, cu_half
    else:
        yield second, first, False, cu_half
        yield second, second, False, cu_half


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    return t if rows is None else t[rows]


def _merge(out: Tensor, lse: Tensor, rows: Tensor | None, part: Tensor, part_lse: Tensor):
    """Fold a partial result for `rows` into the fp32 accumulators (in place)."""
    rows = torch.arange(out.shape[0], device=out.device) if rows is None else rows
    old, old_lse = out[rows], lse[:, rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    merged = old * (old_lse - new_lse).exp().T[..., None]
    out[rows] = merged + part.float() * (part_lse - new_lse).exp().T[..., None]
    lse[:, rows] = new_lse


class RingAttention(torch.autograd.Function):
    """out = causal attention of local q over the K/V of every rank of `group`."""

    @staticmethod
    def forward(ctx, q, k, v, cu, group, attention_fn, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        first, second, cu_half = _halves(cu, q.device)
        cu_local = torch.tensor(cu, dtype=torch.int32, device=q.device)
        layout = (first, second, cu_local, cu_half)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[1::-1], float("-inf"), device=q.device)
        kv = torch.stack([k, v])  # one message per step
        for step in range(size):
            pending = start_shift(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            for rows, cols, causal, cu_blk in _blocks(step, source, rank, layout):
                part = attention_fn(
                    _take(q, rows), _take(kv[0], cols), _take(kv[1], cols),
                    causal=causal, cu_seqlens=cu_blk, scale=scale, return_lse=True,
                )  # fmt: skip
                _merge(out, lse, rows, *part)
            if pending is not None:
                _wait(pending)
                kv = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.attention_fn, ctx.scale = layout, group, attention_fn, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, fn = ctx.group, ctx.attention_fn
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.float()
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(size):
            pending = start_shift(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            for rows, cols, causal, cu_blk in _blocks(step, source, rank, ctx.layout):
                lse_rows = lse if rows is None else lse[:, rows]
                grads = _block_grads(
                    fn, ctx.scale, causal, cu_blk, _take(q, rows), _take(kv[0], cols),
                    _take(kv[1], cols), _take(dout, rows), _take(out, rows), lse_rows,
                )  # fmt: skip
                _accumulate(dq, rows, grads[0])
                _accumulate(dkv[0], cols, grads[1])
                _accumulate(dkv[1], cols, grads[2])
            if pending is not None:  # the next K/V came in while we computed
                _wait(pending)
                kv, dkv = pending[0], shift(dkv, group)
        if size > 1:
            dkv = shift(dkv, group)  # home to the rank that owns these K/V
        dtype = q.dtype
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None, None


def _block_grads(fn, scale, causal, cu, q, k, v, dout, out, lse):
    """dq, dk, dv of one block: recompute it, then push through the merge's gradient.

    With weight w = exp(lse_block - lse), the merged output gets w * out_block, so
    d out_block = w * dout and d lse_block = w * <dout, out_block - out>.
    """
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        part, part_lse = fn(q, k, v, causal=causal, cu_seqlens=cu, scale=scale, return_lse=True)
        weight = (part_lse - lse).exp().T  # (tokens, heads)
        d_part = (dout * weight[..., None]).to(part.dtype)
        d_lse = (weight * (dout * (part.float() - out)).sum(-1)).T
        return torch.autograd.grad((part, part_lse), (q, k, v), (d_part, d_lse))


def _wait(pending: tuple[Tensor, list]) -> None:
    for request in pending[1]:
        request.wait()


def _accumulate(total: Tensor, rows: Tensor | None, grad: Tensor) -> None:
    if rows is None:
        total += grad.float()
    else:
        total.index_add_(0, rows, grad.float())
