"""Context parallel attention: the sequence split over the ``cp`` ranks, on any device.

Layout (all modes): every document (a row of a batch, or a packed document) is cut into
2 x cp equal chunks and rank r holds chunks r and 2cp-1-r (zig-zag), so causal attention
costs every rank the same. Packed documents are padded to a multiple of 2 x cp first
(`packed_shard_index`), as Megatron-Core and TransformerEngine do for THD inputs.

Modes, with cp = ring x ulysses (ulysses ranks are neighbours on the cp axis):

- ``ulysses``: an all-to-all trades the sequence shard for a head shard, attention runs on
  whole documents (so windows and packing need nothing special), and a second all-to-all
  trades back. Needs heads (and kv heads, or their multiples) divisible by ulysses.
- ``ring``: K/V blocks travel round the ring; each rank attends its queries to every
  visiting block with the right mask (causal on its own block, full on the blocks before,
  skipped after) and merges the partial results with their log-sum-exp.
- ``hybrid``: Ulysses inside groups of neighbours, then ring across the groups.

The attention kernels are injected (`attention_fn`, the mindspeed_ops.attention signature
with ``return_lse=True``, and optionally `attention_bwd_fn`, mindspeed_ops.attention_backward's:
block gradients from merged out/lse), so mindspeed-core needs no kernels of its own; the
defaults are plain PyTorch. Backward: the Ulysses all-to-alls are differentiable (`cp_comm`);
the ring is one autograd Function (`ring_attention`) that keeps only local tensors and sends
dK/dV round the ring. Windows work in every mode (the ring passes each chunk pair's offset) and
so do soft-capped scores and attention sinks (`sinks`: merged once, after every key block).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel.cp_comm import HeadsToSeq, SeqToHeads
from mindspeed_core.parallel.ring_attention import RingAttention

CP_MODES = ("ring", "ulysses", "hybrid")
AttentionFn = Callable[..., tuple[Tensor, Tensor]]


def cp_degrees(cp: int, mode: str, ulysses_degree: int | None = None) -> tuple[int, int]:
    """(ring, ulysses) degrees of a cp axis; raises ParallelError naming the bad value."""
    if mode not in CP_MODES:
        raise ParallelError(f"cp_mode={mode!r} is not one of {', '.join(CP_MODES)}")
    if mode == "ring":
        return cp, 1
    if mode == "ulysses":
        return 1, cp
    if not isinstance(ulysses_degree, int) or ulysses_degree < 1 or cp % ulysses_degree:
        raise ParallelError(
            f"cp_mode=hybrid needs ulysses_degree dividing cp={cp}, got {ulysses_degree!r}"
        )
    return cp // ulysses_degree, ulysses_degree


def check_cp_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    """Ulysses splits heads: q heads by `ulysses`; kv heads too, or repeated up to it."""
    if ulysses == 1:
        return
    if num_heads % ulysses:
        raise ParallelError(
            f"Ulysses context parallel over {ulysses} ranks needs num_heads divisible by "
            f"{ulysses}, got num_heads={num_heads}"
        )
    if num_kv_heads % ulysses and ulysses % num_kv_heads:
        raise ParallelError(
            f"Ulysses context parallel over {ulysses} ranks needs num_kv_heads={num_kv_heads} "
            f"to divide or be divisible by {ulysses}"
        )


# -- sharding ----------------------------------------------------------------------------


def shard_sequence(
    tensor: Tensor, cp_rank: int, cp: int, dim: int = 1, load_balance: bool = True
) -> Tensor:
    """This rank's part of `tensor` along `dim`: chunks r and 2cp-1-r of 2cp (zig-zag), or
    chunk r of cp without `load_balance`. The attention of this module needs zig-zag."""
    parts = 2 * cp if load_balance else cp
    if tensor.shape[dim] % parts:
        raise ParallelError(
            f"sequence length {tensor.shape[dim]} is not divisible by {parts} "
            f"({'2 x ' if load_balance else ''}cp={cp})"
        )
    chunks = tensor.chunk(parts, dim)
    if not load_balance:
        return chunks[cp_rank]
    return torch.cat([chunks[cp_rank], chunks[parts - 1 - cp_rank]], dim)


def unshard_sequence(
    tensor: Tensor, group: ProcessGroup, dim: int = 1, load_balance: bool = True
) -> Tensor:
    """The inverse of `shard_sequence` (all-gather over `group`; not differentiable)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    if not load_balance:
        return torch.cat(pieces, dim)
    halves = [p.chunk(2, dim) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def packed_shard_index(cu_seqlens: Tensor, cp_rank: int, cp: int) -> tuple[Tensor, Tensor]:
    """Zig-zag every packed document: which global tokens this rank holds.

    Each document is padded at its end to a multiple of 2 x cp (padding comes after every
    real token, so causal attention never lets a real token see it) and cut into 2 x cp
    chunks; the rank keeps chunks r and 2cp-1-r of each.

    Returns:
        index: int64 (local_tokens,) positions in the flattened tokens, -1 for padding.
        cu_seqlens: int32 (num_docs + 1,) boundaries of the local documents.
    """
    pieces, bounds = [], [0]
    for start, end in pairwise(cu_seqlens.tolist()):
        if end == start:
            continue
        chunk = -(-(end - start) // (2 * cp))  # ceil
        for c in (cp_rank, 2 * cp - 1 - cp_rank):
            positions = torch.arange(start + c * chunk, start + (c + 1) * chunk)
            pieces.append(torch.where(positions < end, positions, -1))
        bounds.append(bounds[-1] + 2 * chunk)
    device = cu_seqlens.device
    index = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=torch.long)
    return index, torch.tensor(bounds, dtype=torch.int32, device=device)


def gather_tokens(flat: Tensor, index: Tensor, pad_value: float | int = 0) -> Tensor:
    """`flat[index]` along dim 0, with `pad_value` where index is -1."""
    taken = flat[index.clamp(min=0)]
    pad = (index < 0).view(-1, *([1] * (flat.dim() - 1)))
    return taken.masked_fill(pad, pad_value)


def unshard_packed(local: Tensor, index: Tensor, num_tokens: int, group: ProcessGroup) -> Tensor:
    """The inverse of `packed_shard_index` + `gather_tokens` (all-gather, padding dropped)."""
    size = dist.get_world_size(group)
    values = [torch.empty_like(local) for _ in range(size)]
    indices = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(values, local.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    values, indices = torch.cat(values), torch.cat(indices)
    out = local.new_zeros(num_tokens, *local.shape[1:])
    real = indices >= 0
    out[indices[real]] = values[real]
    return out


# -- attention ---------------------------------------------------------------------------


def _reference_scores(q, k, causal, window, scale, softcap, offset):
    """fp32 masked scores (heads, sq, sk) of one document, and tanh of the capped scores."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, 1)
    scores = torch.einsum("shd,thd->hst", q.float(), keys) * scale
    capped = None
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    i = torch.arange(q.shape[0], device=q.device)[:, None]
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    d = i + offset - j
    allowed = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        allowed = allowed & (d.abs() < window)
    return scores.masked_fill(~allowed, float("-inf")), capped


def _documents(cu_seqlens: Tensor, offsets: Tensor | None):
    bounds = cu_seqlens.tolist()
    offs = [0] * (len(bounds) - 1) if offsets is None else offsets.tolist()
    return [(a, b, o) for (a, b), o in zip(pairwise(bounds), offs, strict=True) if b > a]


def reference_attention(
    q, k, v, *, causal=True, window=None, cu_seqlens, scale=None, softcap=None, offsets=None,
    return_lse=True,
):  # fmt: skip
    """Plain PyTorch packed attention -> (out, lse (heads, tokens)): the default kernel.
    `offsets` (per document) places its queries that far after its keys (ring chunks)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = q.new_zeros(*q.shape[:2], v.shape[-1])
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    outs, lses = [], []
    for a, b, offset in _documents(cu_seqlens, offsets):
        scores, _ = _reference_scores(q[a:b], k[a:b], causal, window, scale, softcap, offset)
        values = v[a:b].float().repeat_interleave(group, 1)
        lses.append(scores.logsumexp(-1))
        probs = scores.softmax(-1).nan_to_num(0.0)
        outs.append(torch.einsum("hst,thd->shd", probs, values).to(q.dtype))
    if outs:
        out, lse = torch.cat(outs), torch.cat(lses, 1)
    return out, lse


def reference_attention_backward(
    dout, q, k, v, out, lse, *, causal=True, window=None, cu_seqlens, scale=None, softcap=None,
    offsets=None,
):  # fmt: skip
    """(dq, dk, dv) of a block from the merged `out` and `lse` of all blocks (flash-attention's
    backward, no recompute of the block's forward): the default ring backward."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for a, b, offset in _documents(cu_seqlens, offsets):
        scores, capped = _reference_scores(q[a:b], k[a:b], causal, window, scale, softcap, offset)
        probs = torch.exp(scores - lse[:, a:b, None]).nan_to_num(0.0)  # (heads, sq, sk)
        do = dout[a:b].float()
        values = v[a:b].float().repeat_interleave(group, 1)
        delta = (do * out[a:b].float()).sum(-1).T[..., None]  # (heads, sq, 1)
        dscores = probs * (torch.einsum("shd,thd->hst", do, values) - delta)
        if capped is not None:
            dscores = dscores * (1 - capped * capped)
        keys = k[a:b].float().repeat_interleave(group, 1)
        dq[a:b] = torch.einsum("hst,thd->shd", dscores, keys) * scale
        dk_rep = torch.einsum("hst,shd->thd", dscores, q[a:b].float()) * scale
        dv_rep = torch.einsum("hst,shd->thd", probs, do)
        dk[a:b] = dk_rep.unflatten(1, (k.shape[1], group)).sum(2)
        dv[a:b] = dv_rep.unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Packed attention out (tokens, heads, dv) over the keys with lse (heads, tokens) ->
    the out over the keys and the per-head sink logits (keys whose value is 0)."""
    weight = torch.sigmoid(lse - sinks.float()[:, None])  # exp(lse - logaddexp(lse, sink))
    return (out.float() * weight.T[..., None]).to(out.dtype)


def _ulysses_order(cu: list[int], size: int, device) -> Tensor:
    """After the all-to-all the tokens are [rank 0's, rank 1's, ...]; this index puts each
    document in the group's zig-zag order: first chunks ascending, second descending."""
    tokens, pieces = cu[-1], []
    for a, b in pairwise(cu):
        half = (b - a) // 2
        pieces += [j * tokens + a + torch.arange(half) for j in range(size)]
        pieces += [j * tokens + a + half + torch.arange(half) for j in reversed(range(size))]
    return torch.cat(pieces).to(device)


@dataclass
class ContextParallel:
    """Attention over the zig-zag shards of a cp group; what `apply_cp` hands to modules.

    Args:
        ring_group: ranks K/V travel round (None: no ring).
        ulysses_group: ranks heads are traded with (None: no Ulysses).
        attention_fn: ``fn(q, k, v, *, causal, cu_seqlens, scale, return_lse[, window, offsets,
            softcap])`` on packed (tokens, heads, head_dim) inputs -> (out, lse (heads, tokens)).
        attention_bwd_fn: ``fn(dout, q, k, v, out, lse, *, causal, cu_seqlens, scale[, window,
            offsets, softcap])`` -> (dq, dk, dv) from merged statistics; None: the ring
            recomputes each block with `attention_fn` and differentiates it (needs a
            differentiable lse).
    """

    ring_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None
    attention_fn: AttentionFn = reference_attention
    attention_bwd_fn: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = (
        reference_attention_backward
    )

    # Under torch.compile the attention runs eagerly between the block's two graphs: its
    # ring loop reads the document boundaries as Python ints and talks to other ranks.
    @torch.compiler.disable
    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        window: int | None = None,
        cu_seqlens: Tensor | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence.

        Args:
            q, k, v: (batch, local_seq, heads, head_dim), each row sharded by
                `shard_sequence`; or (local_tokens, heads, head_dim) with `cu_seqlens`
                from `packed_shard_index`.
            window: sliding window.
            softcap: cap the scores at +-softcap with tanh (soft-capped logits).
            sinks: (heads,) logits, one per query head, in every row's softmax denominator
                (gpt-oss's attention sinks); None: none.
        """
        batched = cu_seqlens is None
        if batched:
            batch, seq = q.shape[:2]
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            cu = list(range(0, (batch + 1) * seq, seq))
        else:
            cu = cu_seqlens.tolist()
        if any((b - a) % 2 for a, b in pairwise(cu)):
            raise ParallelError(
                "context parallel needs every local sequence/document to hold two zig-zag "
                "chunks (an even token count); shard with shard_sequence or packed_shard_index"
            )
        out = self._attend(q, k, v, cu, window, scale, softcap, sinks)
        return out.view(batch, seq, *out.shape[1:]) if batched else out

    def _attend(self, q, k, v, cu, window, scale, softcap, sinks=None):
        ulysses = 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)
        if ulysses > 1:
            check_cp_heads(q.shape[1], k.shape[1], ulysses)
            if k.shape[1] < ulysses:  # GQA with fewer kv heads than ranks: repeat them
                k, v = (t.repeat_interleave(ulysses // t.shape[1], 1) for t in (k, v))
            if sinks is not None:  # this rank now holds a slice of the heads
                sinks = sinks.chunk(ulysses)[dist.get_rank(self.ulysses_group)]
            order = _ulysses_order(cu, ulysses, q.device)
            q, k, v = (SeqToHeads.apply(t, self.ulysses_group)[order] for t in (q, k, v))
            cu = [c * ulysses for c in cu]
        if self.ring_group is not None and dist.get_world_size(self.ring_group) > 1:
            kernels = (self.attention_fn, self.attention_bwd_fn)
            out = RingAttention.apply(
                q, k, v, cu, self.ring_group, kernels, scale, window, softcap, sinks
            )
        else:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
            extra = {} if softcap is None else {"softcap": softcap}
            out, lse = self.attention_fn(
                q, k, v, causal=True, window=window, cu_seqlens=cu_t, scale=scale,
                return_lse=True, **extra,
            )  # fmt: skip
            if sinks is not None:  # through the (differentiable) lse of the whole sequence
                out = merge_sinks(out, lse, sinks)
        if ulysses > 1:
            out = HeadsToSeq.apply(out[torch.argsort(order)], self.ulysses_group)
        return out

    @classmethod
    def from_mesh(
        cls,
        cp_mesh: DeviceMesh,
        mode: str = "ring",
        ulysses_degree: int | None = None,
        attention_fn: AttentionFn | None = None,
        attention_bwd_fn: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> ContextParallel:
        """Split the 1-D `cp_mesh` into ring x ulysses sub-groups (collective). Without
        `attention_fn` both kernels are the plain PyTorch defaults; with one and no
        `attention_bwd_fn`, the ring recomputes blocks in backward."""
        if cp_mesh.ndim != 1:
            raise ParallelError(f"context parallel needs a 1-D cp mesh, got {cp_mesh.ndim}-D")
        ring, ulysses = cp_degrees(cp_mesh.size(), mode, ulysses_degree)
        kernels = {"attention_fn": attention_fn or reference_attention}
        kernels["attention_bwd_fn"] = (
            attention_bwd_fn if attention_fn is not None else reference_attention_backward
        )
        if ulysses == 1:
            return cls(ring_group=cp_mesh.get_group(), **kernels)
        if ring == 1:
            return cls(ulysses_group=cp_mesh.get_group(), **kernels)
        view = cp_mesh._unflatten(0, (ring, ulysses), ("cp_ring", "cp_ulysses"))
        return cls(
            ring_group=view["cp_ring"].get_group(),
            ulysses_group=view["cp_ulysses"].get_group(),
            **kernels,
        )


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh | None,
    *,
    mode: str = "ring",
    ulysses_degree: int | None = None,
    attention_fn: AttentionFn | None = None,
    attention_bwd_fn: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None,
) -> nn.Module:
    """Make every module of `model` that declares a `context_parallel` attribute (None
    when off) attend over `cp_mesh`; None is a no-op. Inputs must be zig-zag sharded
    (`shard_sequence`, `packed_shard_index`) and RoPE positions global.

    Raises:
        ParallelError: a bad mode/degree, or a model with no such module.
    """
    if cp_mesh is None:
        return model
    targets = [m for m in model.modules() if hasattr(m, "context_parallel")]
    if not targets:
        raise ParallelError(
            f"{type(model).__name__} has no module with a `context_parallel` attribute"
        )
    context = ContextParallel.from_mesh(
        cp_mesh, mode, ulysses_degree, attention_fn, attention_bwd_fn
    )
    for module in targets:
        module.context_parallel = context
    return model
