"""Scaled dot-product attention: causal, GQA/MQA, sliding window, logit soft-capping, packed
documents, a value head size of its own, and the log-sum-exp of every query row so that context
parallel can merge partial results. O(tokens) memory on every backend but the reference.

Layouts: batched q (batch, seq, heads_q, head_dim), k (batch, seq, heads_kv, head_dim), v
(batch, seq, heads_kv, v_head_dim); or packed q (tokens, heads_q, head_dim), ... with
`cu_seqlens` (num_seqs + 1,) cumulative lengths starting at 0. Query head h reads key/value
head h // (heads_q // heads_kv). With d = i + offset - j (offset 0 unless `offsets` is given),
query i may see key j when d >= 0 (causal) and |d| < window (if a window is set). A soft cap c
turns the scores s into c * tanh(s / c) before the mask (Gemma 2). Attention sinks (gpt-oss):
a learned logit per query head joins every row's softmax denominator as a key with a zero
value, so a row may give part of its weight to nothing.
lse is fp32, (batch, heads_q, seq) or (heads_q, tokens), and it is differentiable; with sinks
it includes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops import attention_dispatch
from mindspeed_ops import attention_kernels as kernels
from mindspeed_ops.attention_kernels import NO_WINDOW, default_scale
from mindspeed_ops.backends import eager_inference, resolve_impl
from mindspeed_ops.validate import check_cu_seqlens, check_float, check_index, check_same_device

# -- the oracle ----------------------------------------------------------------------------


def _segment_reference(q, k, v, causal, window, softcap, scale, offset, sinks=None):
    """q (sq, hq, d), k (sk, hkv, d), v (sk, hkv, dv) -> out (sq, hq, dv), lse (hq, sq)."""
    group = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math, fp64 for fp64 inputs
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,thd->hst", q.to(acc), kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    mask = kernels.allowed(q.shape[0], k.shape[0], causal, window, offset, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per row: the head's sink logit (its value is 0)
        sink = sinks.to(acc)[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = scores.logsumexp(-1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees no key: zeros
    probs = probs if sinks is None else probs[..., :-1]
    out = torch.einsum("hst,thd->shd", probs, vf)
    return out.to(q.dtype), lse.float()


def attention_reference(
    q, k, v, *, causal=True, window=None, cu_seqlens=None, scale=None, softcap=None, offsets=None,
    sinks=None, cu_seqlens_k=None,
):  # fmt: skip
    """The oracle: -> (out, lse), plain PyTorch math in fp32 (fp64 for fp64 inputs; lse is
    returned in fp32), autograd all the way."""
    window = NO_WINDOW if window is None else window
    scale = default_scale(q.shape[-1]) if scale is None else scale
    softcap = softcap or 0.0
    if cu_seqlens is None:
        offs = [0] * len(q) if offsets is None else offsets.tolist()
        pieces = [
            _segment_reference(q[b], k[b], v[b], causal, window, softcap, scale, offs[b], sinks)
            for b in range(len(q))
        ]
        return torch.stack([o for o, _ in pieces]), torch.stack([s for _, s in pieces])
    bounds = cu_seqlens.tolist()
    keys = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    offs = [0] * (len(bounds) - 1) if offsets is None else offsets.tolist()
    out = q.new_zeros(*q.shape[:2], v.shape[-1])
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    pieces = [
        _segment_reference(q[a:b], k[keys[i] : keys[i + 1]], v[keys[i] : keys[i + 1]], causal,
                           window, softcap, scale, offs[i], sinks)  # fmt: skip
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        if b > a
    ]
    out = torch.cat([o for o, _ in pieces]) if pieces else out
    lse = torch.cat([s for _, s in pieces], dim=1) if pieces else lse
    return out, lse


# -- the custom ops (what autograd and torch.compile see) -----------------------------------


@torch.library.custom_op("mindspeed::attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    offsets: Tensor | None,
    causal: bool,
    window: int,
    softcap: float,
    scale: float,
    kernel: str,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Packed q (tokens_q, hq, d), k (tokens_k, hkv, d), v (tokens_k, hkv, dv) ->
    (out (tokens_q, hq, dv), lse (hq, tokens_q) fp32)."""
    out, lse = kernels.forward(kernel, q, k, v, cu_q, cu_k, offsets, causal, window, softcap,
                               scale)  # fmt: skip
    return (out, lse) if sinks is None else merge_sinks(out, lse, sinks)


@_attention_fwd.register_fake
def _(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale, kernel, sinks=None):
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("mindspeed::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    offsets: Tensor | None,
    causal: bool,
    window: int,
    softcap: float,
    scale: float,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.backward(
        kernel, dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
        scale,
    )  # fmt: skip


@_attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap, scale, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale, kernel, sinks = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, offsets, sinks)
    ctx.options = causal, window, softcap, scale, kernel
    ctx.set_materialize_grads(False)  # an unused lse has no gradient (the common case)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, offsets, sinks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    # With sinks, out and lse already include them: the kernels' backward from these merged
    # statistics gives exact dq, dk, dv (a sink is one more key whose value is 0).
    causal, window, softcap, scale, kernel = ctx.options
    kernel = kernel if sinks is None else attention_dispatch.from_statistics(kernel)
    # A recomputing kernel differentiates its own forward with autograd, which a custom op's
    # body cannot record (autograd is dispatched below there), so it runs here instead.
    args = (dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap, scale)
    if kernel in attention_dispatch.RECOMPUTING:
        dq, dk, dv = kernels.backward(kernel, *args)
    else:
        dq, dk, dv = _attention_bwd(*args, kernel)
    dsinks = None if sinks is None else sink_grad(dout, dlse, out, lse, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- sinks ---------------------------------------------------------------------------------


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-head sink logits into packed attention results: out (tokens, heads, dv) and
    lse (heads, tokens) over the keys -> the same over the keys and the sink (a key whose
    value is 0): lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). Differentiable."""
    sink = sinks.float()[:, None]
    merged = torch.logaddexp(lse, sink)
    weight = (lse - merged).exp()  # exp(-inf) = 0 for a row that saw no key
    return (out.float() * weight.T[..., None]).to(out.dtype), merged


def sink_grad(dout: Tensor, dlse: Tensor | None, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks of packed attention from its merged out and lse (sinks included):
    the sink's probability p = exp(sink - lse) times its value gradient minus the row term,
    -p <dout, out>, plus p dlse, summed over the tokens."""
    p = (sinks.float()[:, None] - lse).exp()  # (heads, tokens)
    grad = -(p * (dout.float() * out.float()).sum(-1).T)
    if dlse is not None:
        grad = grad + p * dlse
    return grad.sum(-1).to(sinks.dtype)


# -- validation ----------------------------------------------------------------------------


def _validate(q, k, v, cu_seqlens, causal, window, softcap, offsets, sinks=None,
              cu_seqlens_k=None):  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        check_same_device(name, t, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
    dims = 3 if cu_seqlens is not None else 4
    layout = "(tokens, heads, head_dim) with cu_seqlens" if dims == 3 else (
        "(batch, seq, heads, head_dim)"
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dims:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} must agree on "
                         "all dims but head_dim")  # fmt: skip
    # Batched q and k may differ in length only for full bidirectional attention (a context
    # parallel block against another rank's keys); everything else is self-attention.
    cross_ok = cu_seqlens is None and not causal and window is None
    lead_q = q.shape[:1] if cross_ok else q.shape[:-2]
    lead_k = k.shape[:1] if cross_ok else k.shape[:-2]
    if cu_seqlens_k is not None:  # packed keys in documents of their own: any token count
        lead_q = lead_k = ()
    if lead_q != lead_k or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on all dims but heads"
            + ("" if cross_ok else " (and sequence, when causal, windowed or packed)")
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"heads_q={q.shape[-2]} is not a multiple of heads_kv={k.shape[-2]}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if cu_seqlens is not None:
        check_same_device("cu_seqlens", cu_seqlens, q)
        check_cu_seqlens(cu_seqlens, q.shape[0])
    if cu_seqlens_k is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_k needs cu_seqlens (the queries' documents)")
        check_same_device("cu_seqlens_k", cu_seqlens_k, q)
        check_cu_seqlens(cu_seqlens_k, k.shape[0])
        if cu_seqlens_k.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel() - 1} documents but "
                             f"cu_seqlens {cu_seqlens.numel() - 1}")  # fmt: skip
    if offsets is not None:
        check_index("offsets", offsets)
        count = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if offsets.shape != (count,):
            raise ValueError(f"offsets must have one entry per sequence ({count}), got shape "
                             f"{tuple(offsets.shape)}")  # fmt: skip
    if sinks is not None:
        check_float("sinks", sinks)
        check_same_device("sinks", sinks, q)
        if sinks.shape != (q.shape[-2],):
            raise ValueError(f"sinks must hold one logit per query head ({q.shape[-2]},), got "
                             f"shape {tuple(sinks.shape)}")  # fmt: skip


def _packed(q, k, v, cu_seqlens, cu_seqlens_k=None):
    """Packed views and (cu_q, cu_k) of batched or packed inputs."""
    if cu_seqlens is not None:
        return q, k, v, cu_seqlens, cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    batch, seq, seq_k = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (batch + 1) * seq, seq, device=q.device)
    cu_k = torch.arange(0, (batch + 1) * seq_k, seq_k, device=q.device)
    return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k


# -- the public functions ------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    offsets: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    cu_seqlens_k: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax(q k^T * scale) v with the masks above; `(out, lse)` if `return_lse`.

    Args:
        q, k, v: see the module docstring for layouts; same dtype and device.
        causal: mask keys after the query.
        window: sliding window length (None: unlimited).
        cu_seqlens: packed sequence boundaries, int32/int64, summing to the token count.
        scale: defaults to 1 / sqrt(head_dim).
        softcap: cap the scores at +-softcap with tanh (None: no cap).
        offsets: int (num_seqs,): query i of a sequence sits at i + offset relative to its keys
            (context parallel's ring chunks); None: 0.
        sinks: (heads_q,) learned logit per query head in every row's softmax denominator
            (gpt-oss's attention sinks); None: none.
        return_lse: also return the fp32 log-sum-exp per query row and head.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
        cu_seqlens_k: packed keys and values in documents of their own (with `cu_seqlens`,
            as many): document i's queries attend to its keys, query j sitting at j +
            offsets[i] relative to them. A reply sharing a prompt: its keys are the prompt's
            and its own, its offset the prompt's length. None: the queries' documents.
    """
    _validate(q, k, v, cu_seqlens, causal, window, softcap, offsets, sinks, cu_seqlens_k)
    backend = resolve_impl(impl, q)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if backend == "reference":
        out, lse = attention_reference(
            q, k, v, causal=causal, window=window, cu_seqlens=cu_seqlens, scale=scale,
            softcap=softcap, offsets=offsets, sinks=sinks, cu_seqlens_k=cu_seqlens_k,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    plain = window is None and softcap is None and offsets is None and sinks is None
    if cu_seqlens is None and plain and not return_lse and q.shape[-1] == v.shape[-1]:
        # Plain batched attention: torch's fused SDPA kernels (flash/efficient/CPU flash).
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=scale, enable_gqa=q.shape[2] != k.shape[2],
        )  # fmt: skip
        return out.transpose(1, 2)
    batched = cu_seqlens is None
    qp, kp, vp, cu_q, cu_k = _packed(q, k, v, cu_seqlens, cu_seqlens_k)
    window_arg = NO_WINDOW if window is None else window
    cap = float(softcap or 0.0)
    kernel = attention_dispatch.choose(backend, qp, vp, window_arg, cap, offsets)
    args = (qp.contiguous(), kp.contiguous(), vp.contiguous(), cu_q, cu_k, offsets, causal,
            window_arg, cap, scale, kernel)  # fmt: skip
    if eager_inference(q, k, v, sinks):  # no autograd wanted: skip the custom op's dispatch
        out, lse = kernels.forward(kernel, *args[:-1])
        out, lse = (out, lse) if sinks is None else merge_sinks(out, lse, sinks)
    else:
        out, lse = _attention_fwd(*args, sinks)
    if batched:
        out = out.view(*q.shape[:2], *out.shape[1:])
        lse = lse.view(-1, q.shape[0], q.shape[1]).transpose(0, 1)
    return (out, lse) if return_lse else out


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    cu_seqlens: Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    offsets: Tensor | None = None,
    sinks: Tensor | None = None,
    impl: str = "auto",
    cu_seqlens_k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of packed attention from given `out` and `lse` (no autograd); with
    `sinks`, (dq, dk, dv, dsinks). Takes every argument `attention` takes.

    Context parallel's ring uses it with the *merged* out and lse of all key blocks: then each
    block's gradients are exact parts of the whole (flash-attention's backward), with no
    recompute of the block's forward and no gradient through the block's own lse. With
    `sinks`, `out` and `lse` are those with the sinks in the softmax (as `attention` returns
    them): a sink is a key whose value is zero, so q, k and v get the kernel's gradients of
    that softmax, and each sink -sum over its head's rows of p_sink * rowsum(dout * out).
    """
    _validate(q, k, v, cu_seqlens, causal, window, softcap, offsets, sinks, cu_seqlens_k)
    backend = resolve_impl(impl, q)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    window_arg = NO_WINDOW if window is None else window
    cap = float(softcap or 0.0)
    kernel = "composed" if backend == "reference" else (
        attention_dispatch.from_statistics(attention_dispatch.choose(backend, q, v, window_arg, cap, offsets))
    )
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    grads = kernels.backward(
        kernel, dout.contiguous(), None, q.contiguous(), k.contiguous(), v.contiguous(),
        out.contiguous(), lse.contiguous(), cu_seqlens, cu_k, offsets, causal,
        window_arg, cap, scale,
    )  # fmt: skip
    if sinks is None:
        return grads
    rows = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # (heads, tokens)
    p_sink = torch.exp(sinks.float()[:, None] - lse.float())
    return (*grads, -(p_sink * rows).sum(-1).to(sinks.dtype))
