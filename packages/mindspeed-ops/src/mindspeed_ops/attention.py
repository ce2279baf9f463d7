"""Scaled dot-product attention: causal, GQA/MQA, sliding window, packed sequences, and the
log-sum-exp of every query row so that context parallel can merge partial results.

Layouts: batched q (batch, seq, heads_q, head_dim), k/v (batch, seq, heads_kv, head_dim); or
packed q (tokens, heads_q, head_dim) with `cu_seqlens` (num_seqs + 1,) cumulative lengths
starting at 0. Query head h reads key/value head h // (heads_q // heads_kv).
A `window` of w lets query i see keys i - w < j <= i (causal) or |i - j| < w (not causal).
lse is fp32, (batch, heads_q, seq) or (heads_q, tokens), and it is differentiable.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops.backends import resolve_impl
from mindspeed_ops.validate import check_cu_seqlens, check_float, check_same_device

NO_WINDOW = -1


def _allowed(nq: int, nk: int, causal: bool, window: int, device: torch.device) -> Tensor:
    """(nq, nk) bool: may query i see key j (nq == nk whenever causal or windowed)."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    allowed = j <= i if causal else torch.ones(nq, nk, dtype=torch.bool, device=device)
    if window != NO_WINDOW:
        allowed = allowed & ((i - j).abs() < window)
    return allowed


def _segment_reference(q, k, v, causal, window, scale):
    """q (s, hq, d), k/v (s, hkv, d) -> out (s, hq, d), lse (hq, s); autograd all the way."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,thd->hst", q.float(), kf) * scale
    mask = _allowed(q.shape[0], k.shape[0], causal, window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("hst,thd->shd", torch.softmax(scores, -1), vf)
    return out.to(q.dtype), lse


def _segments(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return [(a, b) for a, b in pairwise(bounds) if b > a]


def _segment_pairs(cu_q: Tensor, cu_k: Tensor) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of every sequence with at least one query."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [
        (slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1]))
        for i in range(len(bq) - 1)
        if bq[i + 1] > bq[i]
    ]


def attention_reference(q, k, v, *, causal=True, window=None, cu_seqlens=None, scale=None):
    """The oracle: -> (out, lse), plain PyTorch math in fp32."""
    window = NO_WINDOW if window is None else window
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cu_seqlens is None:
        pieces = [
            _segment_reference(q[b], k[b], v[b], causal, window, scale) for b in range(len(q))
        ]
        return torch.stack([o for o, _ in pieces]), torch.stack([s for _, s in pieces])
    out = torch.zeros_like(q)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    pieces = [
        (a, b, _segment_reference(q[a:b], k[a:b], v[a:b], causal, window, scale))
        for a, b in _segments(cu_seqlens)
    ]
    out = torch.cat([o for _, _, (o, _) in pieces]) if pieces else out
    lse = torch.cat([s for _, _, (_, s) in pieces], dim=1) if pieces else lse
    return out, lse


def _grouped(t: Tensor, num_kv: int) -> Tensor:
    """(s, hq, d) -> fp32 (hkv, group, s, d)."""
    s, hq, d = t.shape
    return t.float().view(s, num_kv, hq // num_kv, d).permute(1, 2, 0, 3)


def _ungrouped(t: Tensor) -> Tensor:
    """(hkv, group, s, d) -> (s, hq, d)."""
    hkv, group, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s, hkv * group, d)


def _scores(q, k, causal, window, scale):
    """fp32 masked scores (hkv, group, s, s) for one segment."""
    kk = k.float().permute(1, 0, 2).unsqueeze(1)
    scores = (_grouped(q, k.shape[1]) @ kk.transpose(-1, -2)) * scale
    mask = _allowed(q.shape[0], k.shape[0], causal, window, q.device)
    return scores.masked_fill_(~mask, float("-inf"))


def _segment_fwd(q, k, v, causal, window, scale):
    scores = _scores(q, k, causal, window, scale)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = probs @ v.float().permute(1, 0, 2).unsqueeze(1)
    return _ungrouped(out).to(q.dtype), lse.flatten(0, 1)


def _segment_bwd(dout, dlse, q, k, v, out, lse, causal, window, scale):
    """Flash-attention style backward from the saved lse; dlse adds P * dlse to dS."""
    num_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    probs = torch.exp(_scores(q, k, causal, window, scale) - lse.view(num_kv, group, -1, 1))
    dout_g = _grouped(dout, num_kv)
    kk = k.float().permute(1, 0, 2).unsqueeze(1)
    vv = v.float().permute(1, 0, 2).unsqueeze(1)
    dv = (probs.transpose(-1, -2) @ dout_g).sum(1)
    delta = (dout_g * _grouped(out, num_kv)).sum(-1, keepdim=True)
    dscores = probs * (dout_g @ vv.transpose(-1, -2) - delta + dlse.view(num_kv, group, -1, 1))
    dq = _ungrouped(dscores @ kk) * scale
    dk = (dscores.transpose(-1, -2) @ _grouped(q, num_kv)).sum(1) * scale
    return dq, dk.permute(1, 0, 2), dv.permute(1, 0, 2)


@torch.library.custom_op("mindspeed::attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    causal: bool,
    window: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Packed q (tokens_q, hq, d), k/v (tokens_k, hkv, d) -> (out, lse (hq, tokens_q) fp32)."""
    out = torch.zeros_like(q)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for sq, sk in _segment_pairs(cu_q, cu_k):
        out[sq], lse[:, sq] = _segment_fwd(q[sq], k[sk], v[sk], causal, window, scale)
    return out, lse


@_attention_fwd.register_fake
def _(q, k, v, cu_q, cu_k, causal, window, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("mindspeed::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: Tensor,
    dlse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    causal: bool,
    window: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk in _segment_pairs(cu_q, cu_k):
        grads = _segment_bwd(
            dout[sq], dlse[:, sq], q[sq], k[sk], v[sk], out[sq], lse[:, sq],
            causal, window, scale,
        )  # fmt: skip
        dq[sq], dk[sk], dv[sk] = grads
    return dq, dk, dv


@_attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, cu_q, cu_k, causal, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, causal, window, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
    dq, dk, dv = _attention_bwd(
        dout, dlse, q, k, v, out, lse, cu_q, cu_k, ctx.causal, ctx.window, ctx.scale
    )
    return dq, dk, dv, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _validate(q, k, v, cu_seqlens, causal, window):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        check_same_device(name, t, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
    dims = 3 if cu_seqlens is not None else 4
    layout = (
        "(tokens, heads, head_dim) with cu_seqlens"
        if dims == 3
        else "(batch, seq, heads, head_dim)"
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dims:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    # Batched q and k may differ in length only for full bidirectional attention (a context
    # parallel block against another rank's keys); everything else is self-attention.
    cross_ok = cu_seqlens is None and not causal and window is None
    lead_q, lead_k = (
        q.shape[:1] if cross_ok else q.shape[:-2],
        k.shape[:1] if cross_ok else k.shape[:-2],
    )
    if lead_q != lead_k or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on all dims but heads"
            + ("" if cross_ok else " (and sequence, when causal, windowed or packed)")
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"heads_q={q.shape[-2]} is not a multiple of heads_kv={k.shape[-2]}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if cu_seqlens is not None:
        check_same_device("cu_seqlens", cu_seqlens, q)
        check_cu_seqlens(cu_seqlens, q.shape[0])


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    impl: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax(q k^T * scale) v with the masks above; `(out, lse)` if `return_lse`.

    Args:
        q, k, v: see the module docstring for layouts; same dtype and device.
        causal: mask keys after the query.
        window: sliding window length (None: unlimited).
        cu_seqlens: packed sequence boundaries, int32/int64, summing to the token count.
        scale: defaults to 1 / sqrt(head_dim).
        return_lse: also return the fp32 log-sum-exp per query row and head.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    _validate(q, k, v, cu_seqlens, causal, window)
    backend = resolve_impl(impl, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if backend == "reference":
        out, lse = attention_reference(
            q, k, v, causal=causal, window=window, cu_seqlens=cu_seqlens, scale=scale
        )
        return (out, lse) if return_lse else out
    if cu_seqlens is None and window is None and not return_lse:
        # Plain batched attention: torch's fused SDPA kernels (flash/efficient/CPU flash).
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)
    return _attention_packed(q, k, v, causal, window, cu_seqlens, scale, return_lse)


def _attention_packed(q, k, v, causal, window, cu_seqlens, scale, return_lse):
    batched = cu_seqlens is None
    if batched:
        batch, seq, seq_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(0, (batch + 1) * seq, seq, device=q.device)
        cu_k = torch.arange(0, (batch + 1) * seq_k, seq_k, device=q.device)
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    else:
        cu_q = cu_k = cu_seqlens
    window = NO_WINDOW if window is None else window
    out, lse = _attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, causal, window, scale
    )
    if batched:
        out = out.view(batch, seq, *out.shape[1:])
        lse = lse.view(-1, batch, seq).transpose(0, 1)
    return (out, lse) if return_lse else out
