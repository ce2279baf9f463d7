"""Zig-zag ring attention as one autograd Function: memory of the local K/V only.

Each rank holds, per document, zig-zag chunks r and 2R-1-r (its first and second half).
At ring step s the K/V of rank r-s visit; with the chunk order, the visit is one of:

- s = 0, its own K/V: causal over the local documents;
- source < r: its first chunk precedes both of ours and its second follows both, so all
  our queries see its first chunk, fully;
- source > r: both its chunks lie between ours, so only our second chunk sees them, fully.

Partial results merge through their log-sum-exp. Both passes prefetch the next K/V while
they compute. Backward sends the K/V round again with their dK/dV accumulators: each block's
gradients come from the injected backward kernel given the merged out and lse (flash-attention
style; or, without one, from recomputing the block and differentiating through the merge), and
after the last step the accumulators take one more step home to their owner.

Attention sinks (a learned logit per head in every row's softmax denominator, gpt-oss) join
the merge once, after the last block, as a key whose value is 0; the blocks' backward from the
merged statistics is then exact as it stands, and the sinks' own gradient comes from them too.

A sliding window needs true positions: every call is then one chunk pair, with the query
chunk's distance after the key chunk passed as per-document `offsets`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from mindspeed_core.parallel.cp_comm import shift_many, start_shift_many, wait_many


def _halves(cu: list[int], device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token indices of the first and second half of every local document, the boundaries of
    the halves (each half is one zig-zag chunk), and each half's length."""
    first, second, bounds = [], [], [0]
    for a, b in pairwise(cu):
        half = (b - a) // 2
        first.append(torch.arange(a, a + half))
        second.append(torch.arange(a + half, b))
        bounds.append(bounds[-1] + half)
    as_tensor = torch.tensor(bounds, dtype=torch.int32, device=device)
    lengths = torch.tensor([b - a for a, b in pairwise(bounds)], dtype=torch.long)
    return torch.cat(first).to(device), torch.cat(second).to(device), as_tensor, lengths


class Block(NamedTuple):
    rows: Tensor | None  # query rows (None: all)
    cols: Tensor | None  # key rows (None: all)
    causal: bool
    cu: Tensor
    offsets: Tensor | None  # per document: how many chunks' worth the queries sit after


def _blocks(step: int, source: int, rank: int, size: int, layout, windowed: bool):
    """The attention calls of ring step `step` (K/V of rank `source` visiting `rank`).

    Chunk c of a document holds its tokens c*C..(c+1)*C-1; rank r holds chunks r and
    2R-1-r. Without a window, the calls need no positions (causal on the own block, full or
    nothing across). A window needs how far each query chunk sits after each key chunk, so
    every call is a chunk pair with its offset in tokens (`offsets`, per document)."""
    first, second, cu_local, cu_half, half = layout
    last = 2 * size - 1
    if not windowed:
        if step == 0:
            yield Block(None, None, True, cu_local, None)
        elif source < rank:
            yield Block(first, first, False, cu_half, None)
            yield Block(second, first, False, cu_half, None)
        else:
            yield Block(second, first, False, cu_half, None)
            yield Block(second, second, False, cu_half, None)
        return
    pairs = {  # (query chunk, key chunk) per visit
        0: [(rank, rank, first, first), (last - rank, last - rank, second, second),
            (last - rank, rank, second, first)],  # fmt: skip
    }.get(step)
    if pairs is None and source < rank:
        pairs = [(rank, source, first, first), (last - rank, source, second, first)]
    elif pairs is None:
        pairs = [(last - rank, source, second, first), (last - rank, last - source, second, second)]
    for chunk_q, chunk_k, rows, cols in pairs:
        offsets = None if chunk_q == chunk_k else (chunk_q - chunk_k) * half.to(cu_half.device)
        yield Block(rows, cols, True, cu_half, offsets)


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    return t if rows is None else t[rows]


def _merge(out: Tensor, lse: Tensor, rows: Tensor | None, part: Tensor, part_lse: Tensor):
    """Fold a partial result for `rows` into the fp32 accumulators (in place). Rows that saw
    no key in either have lse -inf and keep weight 0."""
    rows = torch.arange(out.shape[0], device=out.device) if rows is None else rows
    old, old_lse = out[rows], lse[:, rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    keep = (old_lse - new_lse).exp().nan_to_num(0.0).T[..., None]
    take = (part_lse - new_lse).exp().nan_to_num(0.0).T[..., None]
    out[rows] = old * keep + part.float() * take
    lse[:, rows] = new_lse


def _options(block: Block, scale, window, softcap) -> dict:
    """Keyword arguments of a kernel call; the optional ones only when used, so that a plain
    attention function (no windows, no caps) still serves unwindowed rings."""
    options = dict(causal=block.causal, cu_seqlens=block.cu, scale=scale)
    if window is not None:
        options.update(window=window, offsets=block.offsets)
    if softcap is not None:
        options["softcap"] = softcap
    return options


class RingAttention(torch.autograd.Function):
    """out = causal attention of local q over the K/V of every rank of `group` (and over
    `sinks`, (heads,) logits, if given)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, group, kernels, scale, window, softcap, sinks=None):
        attention_fn = kernels[0]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        first, second, cu_half, half = _halves(cu, q.device)
        cu_local = torch.tensor(cu, dtype=torch.int32, device=q.device)
        layout = (first, second, cu_local, cu_half, half)
        out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[1::-1], float("-inf"), device=q.device)
        kv = (k, v)
        for step in range(size):
            pending = start_shift_many(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            for block in _blocks(step, source, rank, size, layout, window is not None):
                part = attention_fn(
                    _take(q, block.rows), _take(kv[0], block.cols), _take(kv[1], block.cols),
                    return_lse=True, **_options(block, scale, window, softcap),
                )  # fmt: skip
                _merge(out, lse, block.rows, *part)
            if pending is not None:
                kv = wait_many(pending)
        if sinks is not None:  # one more "block": the sink logits, with value 0
            sink_lse = sinks.detach().float()[:, None].expand(-1, q.shape[0])
            _merge(out, lse, None, torch.zeros_like(out), sink_lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout, ctx.group, ctx.kernels = layout, group, kernels
        ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device))  # fmt: skip
        for step in range(size):
            pending = start_shift_many(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            for block in _blocks(step, source, rank, size, ctx.layout, ctx.window is not None):
                grads = _block_grads(
                    ctx.kernels, _options(block, ctx.scale, ctx.window, ctx.softcap),
                    _take(q, block.rows), _take(kv[0], block.cols), _take(kv[1], block.cols),
                    _take(dout, block.rows), _take(out, block.rows),
                    lse if block.rows is None else lse[:, block.rows],
                )  # fmt: skip
                _accumulate(dq, block.rows, grads[0])
                _accumulate(dkv[0], block.cols, grads[1])
                _accumulate(dkv[1], block.cols, grads[2])
            if pending is not None:  # the next K/V came in while we computed
                kv, dkv = wait_many(pending), shift_many(dkv, group)
        if size > 1:
            dkv = shift_many(dkv, group)  # home to the rank that owns these K/V
        dsinks = None
        if sinks is not None:  # -sum over rows of p_sink <dout, out>: the sink's value is 0
            p_sink = (sinks.float()[:, None] - lse).exp()  # (heads, tokens)
            dsinks = -(p_sink * (dout.float() * out).sum(-1).T).sum(-1).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None, None, dsinks)  # fmt: skip


def _block_grads(kernels, options, q, k, v, dout, out, lse):
    """dq, dk, dv of one block from the merged `out` and `lse` of all blocks.

    With a backward kernel (flash-attention style) the block's gradients are exact parts of
    the whole: P = exp(s - lse) and the row term <dout, out> come from the merged statistics.
    Without one, the block is recomputed and differentiated through the merge: with weight
    w = exp(lse_block - lse), d out_block = w * dout and d lse_block = w * <dout, out_block - out>.
    """
    attention_fn, backward_fn = kernels
    if backward_fn is not None:
        return backward_fn(dout, q, k, v, out, lse, **options)
    dout = dout.float()
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        part, part_lse = attention_fn(q, k, v, return_lse=True, **options)
        weight = (part_lse - lse).exp().nan_to_num(0.0).T  # (tokens, heads)
        d_part = (dout * weight[..., None]).to(part.dtype)
        d_lse = (weight * (dout * (part.float() - out)).sum(-1)).T
        return torch.autograd.grad((part, part_lse), (q, k, v), (d_part, d_lse))


def _accumulate(total: Tensor, rows: Tensor | None, grad: Tensor) -> None:
    if rows is None:
        total += grad.float()
    else:
        total.index_add_(0, rows, grad.float())
