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

The attention kernel is injected (`attention_fn`, the mindspeed_ops.attention signature
with ``return_lse=True``), so mindspeed-core needs no kernels of its own. Backward: the
Ulysses all-to-alls are differentiable (`cp_comm`); the ring is one autograd Function
(`ring_attention`) that keeps only local tensors and sends dK/dV round the ring.
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


def reference_attention(
    q, k, v, *, causal=True, window=None, cu_seqlens, scale=None, return_lse=True
):
    """Plain PyTorch packed attention -> (out, lse (heads, tokens)): the default kernel."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in pairwise(cu_seqlens.tolist()):
        keys = k[a:b].float().repeat_interleave(group, 1)
        values = v[a:b].float().repeat_interleave(group, 1)
        scores = torch.einsum("shd,thd->hst", q[a:b].float(), keys) * scale
        i = torch.arange(b - a, device=q.device)[:, None]
        j = torch.arange(b - a, device=q.device)[None, :]
        allowed = j <= i if causal else torch.ones_like(i - j, dtype=torch.bool)
        if window is not None:
            allowed = allowed & ((i - j).abs() < window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append(torch.einsum("hst,thd->shd", scores.softmax(-1), values).to(q.dtype))
    return torch.cat(outs), torch.cat(lses, 1)


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
        attention_fn: ``fn(q, k, v, *, causal, window, cu_seqlens, scale, return_lse)``
            on packed (tokens, heads, head_dim) inputs -> (out, lse (heads, tokens)).
    """

    ring_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None
    attention_fn: AttentionFn = reference_attention

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
    ) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence.

        Args:
            q, k, v: (batch, local_seq, heads, head_dim), each row sharded by
                `shard_sequence`; or (local_tokens, heads, head_dim) with `cu_seqlens`
                from `packed_shard_index`.
            window: sliding window (ulysses only: a ring would need global masks).
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
        out = self._attend(q, k, v, cu, window, scale)
        return out.view(batch, seq, *out.shape[1:]) if batched else out

    def _attend(self, q, k, v, cu, window, scale):
        ulysses = 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)
        if ulysses > 1:
            check_cp_heads(q.shape[1], k.shape[1], ulysses)
            if k.shape[1] < ulysses:  # GQA with fewer kv heads than ranks: repeat them
                k, v = (t.repeat_interleave(ulysses // t.shape[1], 1) for t in (k, v))
            order = _ulysses_order(cu, ulysses, q.device)
            q, k, v = (SeqToHeads.apply(t, self.ulysses_group)[order] for t in (q, k, v))
            cu = [c * ulysses for c in cu]
        if self.ring_group is not None and dist.get_world_size(self.ring_group) > 1:
            if window is not None:
                raise ParallelError(
                    f"sliding window={window} is not supported by ring context parallel; "
                    "use cp_mode=ulysses"
                )
            out = RingAttention.apply(q, k, v, cu, self.ring_group, self.attention_fn, scale)
        else:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
            out, _ = self.attention_fn(
                q, k, v, causal=True, window=window, cu_seqlens=cu_t, scale=scale, return_lse=True
            )
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
    ) -> ContextParallel:
        """Split the 1-D `cp_mesh` into ring x ulysses sub-groups (collective)."""
        if cp_mesh.ndim != 1:
            raise ParallelError(f"context parallel needs a 1-D cp mesh, got {cp_mesh.ndim}-D")
        ring, ulysses = cp_degrees(cp_mesh.size(), mode, ulysses_degree)
        fn = attention_fn or reference_attention
        if ulysses == 1:
            return cls(ring_group=cp_mesh.get_group(), attention_fn=fn)
        if ring == 1:
            return cls(ulysses_group=cp_mesh.get_group(), attention_fn=fn)
        view = cp_mesh._unflatten(0, (ring, ulysses), ("cp_ring", "cp_ulysses"))
        return cls(
            ring_group=view["cp_ring"].get_group(),
            ulysses_group=view["cp_ulysses"].get_group(),
            attention_fn=fn,
        )


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh | None,
    *,
    mode: str = "ring",
    ulysses_degree: int | None = None,
    attention_fn: AttentionFn | None = None,
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
    context = ContextParallel.from_mesh(cp_mesh, mode, ulysses_degree, attention_fn)
    for module in targets:
        module.context_parallel = context
    return model
