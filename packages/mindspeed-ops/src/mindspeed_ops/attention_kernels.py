"""The kernels behind `mindspeed_ops.attention`, on packed inputs: forward -> (out, lse) and
backward from the saved (out, lse) -> (dq, dk, dv). None of them builds a (tokens x tokens)
matrix except "composed", the fallback of last resort (one document at a time).

Inputs: q (tokens_q, heads_q, d), k (tokens_k, heads_kv, d), v (tokens_k, heads_kv, d_v),
cu_q/cu_k document boundaries, `offsets` (None, or per document: how far the queries sit after
the keys, for context parallel's ring chunks), causal, window (NO_WINDOW = -1), softcap (0.0 =
none), scale. lse is fp32 (heads_q, tokens_q). `dlse` (the gradient of lse) may be None.

Kernels, by name:
- "cpu_flash": our C++ flash kernel (csrc/flash_attention.cpp): everything above, fp32/bf16/fp16.
- "torch_flash": torch's CPU flash kernel per document (no window, softcap, offsets, d_v != d):
  what the CPU runs when our C++ kernels cannot be built.
- "cuda_flash": torch's variable-length flash attention (`torch.nn.attention.varlen`'s ops,
  flash or cuDNN) with its window; values narrower than keys are zero-padded. fp16/bf16.
- "flex": FlexAttention (compiled) with a document/window/offset mask and the soft cap as a
  score modifier; its backward recomputes the forward under autograd. CUDA.
- "npu_fusion": torch_npu's npu_fusion_attention in TND layout with actual_seq_qlen/kvlen.
- "composed": plain torch per document (fp32 scores of one document): the fallback.

Which kernel runs a call, and why the faster ones were refused, is `attention_dispatch.py`.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.validate import host_values

NO_WINDOW = -1
KERNELS = ("cpu_flash", "torch_flash", "cuda_flash", "flex", "npu_fusion", "composed")


def forward(kernel, q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    return _FORWARD[kernel](q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale)


def backward(kernel, dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window,
             softcap, scale):  # fmt: skip
    if dlse is not None and kernel in ("torch_flash", "cuda_flash", "npu_fusion"):
        kernel = "composed"  # these take no lse gradient (only a direct use of lse has one)
    return _BACKWARD[kernel](
        dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap, scale
    )


def _documents(cu_q: Tensor, cu_k: Tensor, offsets: Tensor | None):
    """(query slice, key slice, offset) of each document with queries."""
    bq, bk = host_values(cu_q), host_values(cu_k)
    offs = [0] * (len(bq) - 1) if offsets is None else offsets.tolist()
    return [
        (slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1]), offs[i])
        for i in range(len(bq) - 1)
        if bq[i + 1] > bq[i]
    ]


# -- cpu_flash: our C++ kernel -------------------------------------------------------------


def _no_offsets(cu_q: Tensor, offsets: Tensor | None) -> Tensor:
    return torch.zeros(cu_q.numel() - 1, dtype=torch.long) if offsets is None else offsets.cpu()


def _cpu_flash_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    ext = cpu_ext.load()
    window = 0 if window == NO_WINDOW else window
    out, lse = ext.flash_attention_fwd(
        q, k, v, cu_q.cpu(), cu_k.cpu(), _no_offsets(cu_q, offsets), causal, window, softcap, scale
    )
    return out, lse


def _cpu_flash_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
                   scale):  # fmt: skip
    ext = cpu_ext.load()
    window = 0 if window == NO_WINDOW else window
    dq, dk, dv = ext.flash_attention_bwd(
        dout, dlse, q, k, v, out, lse, cu_q.cpu(), cu_k.cpu(), _no_offsets(cu_q, offsets),
        causal, window, softcap, scale,
    )  # fmt: skip
    return dq, dk, dv


# -- torch_flash: torch's CPU flash kernel, one document at a time -------------------------


def _heads_first(t: Tensor) -> Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # (s, h, d) -> (1, h, s, d)


def _torch_flash_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for sq, sk, _ in _documents(cu_q, cu_k, None):
        if sk.stop == sk.start:
            continue
        o, s = kernel(*(_heads_first(t) for t in (q[sq], k[sk], v[sk])), 0.0, causal, scale=scale)
        out[sq], lse[:, sq] = o[0].transpose(0, 1), s[0]
    return out, lse


def _torch_flash_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
                     scale):  # fmt: skip
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    for sq, sk, _ in _documents(cu_q, cu_k, None):
        if sk.stop == sk.start:
            continue
        grads = kernel(
            *(_heads_first(t) for t in (dout[sq], q[sq], k[sk], v[sk], out[sq])),
            lse[None, :, sq].contiguous(), 0.0, causal, scale=scale,
        )  # fmt: skip
        dq[sq], dk[sk], dv[sk] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


# -- cuda_flash: torch's variable-length flash attention -----------------------------------


def _flash_window(causal: bool, window: int) -> tuple[bool, list[int]]:
    if window == NO_WINDOW:
        return causal, [-1, 0] if causal else [-1, -1]
    return False, [window - 1, 0] if causal else [window - 1, window - 1]


def _pad_to(t: Tensor, width: int) -> Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


@cache
def varlen_arguments() -> frozenset[str]:
    """The argument names of torch's varlen flash op; empty where this torch has none."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)
    except ImportError:
        return frozenset()
    return frozenset(a.name for a in torch.ops.torch_attn._varlen_attn.default._schema.arguments)


def _int32(cu: Tensor) -> Tensor:
    # Below autograd (in a custom op's body) even a no-op `.to` is dispatched: skip it.
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def _longest(cu: Tensor) -> int:
    """The longest document's length: from the boundaries' host values, or while a CUDA graph
    is recorded the whole token count, the bound of any document a replay may bring (the
    graph replays with later batches' boundaries, the length fixed at recording)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return host_values(cu)[-1]
    bounds = host_values(cu)
    return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _cuda_flash_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    is_causal, window_size = _flash_window(causal, window)
    cu_q32, cu_k32 = _int32(cu_q), _int32(cu_k)
    max_q, max_k = _longest(cu_q), _longest(cu_k)
    # Newer torch (2.14 here) asks for enable_gqa; 2.11's op has no such argument and takes
    # GQA as is (its flash kernel reads each kv head for its group of query heads).
    gqa = {"enable_gqa": k.shape[1] != q.shape[1]} if "enable_gqa" in varlen_arguments() else {}
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        q, k, _pad_to(v, q.shape[-1]), cu_q32, cu_k32, max_q, max_k, is_causal, scale,
        window_size, **gqa,
    )  # fmt: skip
    return out[..., : v.shape[-1]].contiguous(), lse


def _cuda_flash_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
                    scale):  # fmt: skip
    import torch.nn.attention.varlen  # noqa: F401

    is_causal, window_size = _flash_window(causal, window)
    width = q.shape[-1]
    max_q, max_k = _longest(cu_q), _longest(cu_k)
    unused = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        _pad_to(dout, width), q, k, _pad_to(v, width), _pad_to(out, width), lse,
        _int32(cu_q), _int32(cu_k), max_q, max_k, is_causal, unused, scale,
        window_size,
    )  # fmt: skip
    return dq, dk, dv[..., : v.shape[-1]].contiguous()


# -- flex: FlexAttention for what flash cannot take (CUDA) ---------------------------------


@cache
def flex_module():
    """The compiled flex_attention, or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)  # dynamic shapes fail to lower on CPU


def flex_mask_mod(cu_q, cu_k, offsets, causal, window, device):
    """FlexAttention's mask_mod for packed documents: same document, and d = i + offset - j
    within the causal/window bounds (positions counted from each document's start)."""
    tokens_q, tokens_k = host_values(cu_q)[-1], host_values(cu_k)[-1]
    docs_q = torch.bucketize(torch.arange(tokens_q, device=device), cu_q[1:].to(device),
                             right=True)  # fmt: skip
    docs_k = torch.bucketize(torch.arange(tokens_k, device=device), cu_k[1:].to(device),
                             right=True)  # fmt: skip
    start_q, start_k = cu_q[:-1].to(device), cu_k[:-1].to(device)
    offs = torch.zeros_like(start_q) if offsets is None else offsets.to(device)

    def mask_mod(b, h, i, j):
        d = (i - start_q[docs_q[i]]) + offs[docs_q[i]] - (j - start_k[docs_k[j]])
        allowed = docs_q[i] == docs_k[j]
        if causal:
            allowed = allowed & (d >= 0)
        if window != NO_WINDOW:
            allowed = allowed & (d < window) & (d > -window)
        return allowed

    return mask_mod


def flex_run(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale, *, lse=True):
    """FlexAttention on packed inputs -> (out, lse) (lse None when not asked)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = flex_mask_mod(cu_q, cu_k, offsets, causal, window, q.device)
    mask = create_block_mask(mask_mod, None, None, host_values(cu_q)[-1], host_values(cu_k)[-1],
                             device=q.device)  # fmt: skip
    score_mod = None
    if softcap:

        def score_mod(score, b, h, i, j):  # noqa: E306
            return softcap * torch.tanh(score / softcap)

    result = flex_module()(
        *(_heads_first(t) for t in (q, k, v)), score_mod=score_mod, block_mask=mask,
        scale=scale, enable_gqa=k.shape[1] != q.shape[1], return_lse=lse,
    )  # fmt: skip
    out, row_lse = result if lse else (result, None)
    return out[0].transpose(0, 1), None if row_lse is None else row_lse[0].float()


def _flex_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    with torch.no_grad():
        out, lse = flex_run(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale)
    return out.contiguous(), lse.contiguous()


def _flex_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
              scale):  # fmt: skip
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = flex_run(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale)
        outputs, grads = (out,), (dout,)
        if dlse is not None:
            outputs, grads = (out, lse), (dout, dlse)
        return torch.autograd.grad(outputs, (q, k, v), grads)


# -- npu_fusion: torch_npu's fused attention, TND layout -----------------------------------


def _npu_run(q, k, v, cu_q, cu_k, causal, window, scale):
    import torch_npu

    # sparse_mode 3: causal (lower-right aligned, equal lengths here); 4: band; 0: full.
    mask, sparse, pre, nxt = None, 0, 2147483647, 2147483647
    if causal or window != NO_WINDOW:
        mask = torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(1)
        sparse = 3 if window == NO_WINDOW else 4
        if window != NO_WINDOW:
            pre, nxt = window - 1, 0 if causal else window - 1
    result = torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], input_layout="TND", scale=scale, atten_mask=mask,
        sparse_mode=sparse, pre_tockens=pre, next_tockens=nxt,
        actual_seq_qlen=host_values(cu_q)[1:], actual_seq_kvlen=host_values(cu_k)[1:],
    )  # fmt: skip
    out, softmax_max, softmax_sum = result[0], result[1], result[2]
    # (tokens, heads, 8) replicated statistics -> lse (heads, tokens)
    lse = (softmax_max[..., 0] + softmax_sum[..., 0].log()).transpose(0, 1)
    return out, lse.float()


def _npu_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    with torch.no_grad():
        out, lse = _npu_run(q, k, v, cu_q, cu_k, causal, window, scale)
    return out, lse.contiguous()


def _npu_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
             scale):  # fmt: skip
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = _npu_run(q, k, v, cu_q, cu_k, causal, window, scale)
        return torch.autograd.grad(out, (q, k, v), dout)


# -- composed: plain torch, one document at a time -----------------------------------------


def allowed(nq, nk, causal, window, offset, device) -> Tensor:
    """(nq, nk) bool: may query i see key j (d = i + offset - j)."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    d = i + offset - j
    mask = d >= 0 if causal else torch.ones(nq, nk, dtype=torch.bool, device=device)
    if window != NO_WINDOW:
        mask = mask & (d.abs() < window)
    return mask


def _grouped(t: Tensor, num_kv: int) -> Tensor:
    """(s, hq, d) -> fp32 (hkv, group, s, d)."""
    s, hq, d = t.shape
    return t.float().reshape(s, num_kv, hq // num_kv, d).permute(1, 2, 0, 3)


def _ungrouped(t: Tensor) -> Tensor:
    """(hkv, group, s, d) -> (s, hq, d)."""
    hkv, group, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s, hkv * group, d)


def _scores(q, k, causal, window, softcap, scale, offset):
    """fp32 masked scores (hkv, group, sq, sk) of one document, and tanh of the capped ones."""
    kk = k.float().permute(1, 0, 2).unsqueeze(1)
    scores = (_grouped(q, k.shape[1]) @ kk.transpose(-1, -2)) * scale
    capped = None
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    mask = allowed(q.shape[0], k.shape[0], causal, window, offset, q.device)
    return scores.masked_fill_(~mask, float("-inf")), capped


def _composed_fwd(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale):
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for sq, sk, offset in _documents(cu_q, cu_k, offsets):
        scores, _ = _scores(q[sq], k[sk], causal, window, softcap, scale, offset)
        doc_lse = scores.logsumexp(-1)
        probs = torch.exp(scores - doc_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
        o = probs @ v[sk].float().permute(1, 0, 2).unsqueeze(1)
        out[sq], lse[:, sq] = _ungrouped(o).to(q.dtype), doc_lse.flatten(0, 1)
    return out, lse


def _composed_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, offsets, causal, window, softcap,
                  scale):  # fmt: skip
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    num_kv = k.shape[1]
    for sq, sk, offset in _documents(cu_q, cu_k, offsets):
        scores, capped = _scores(q[sq], k[sk], causal, window, softcap, scale, offset)
        doc_lse = lse[:, sq].view(num_kv, -1, sq.stop - sq.start, 1)
        probs = torch.exp(scores - doc_lse).nan_to_num(0.0)
        dout_g = _grouped(dout[sq], num_kv)
        kk = k[sk].float().permute(1, 0, 2).unsqueeze(1)
        vv = v[sk].float().permute(1, 0, 2).unsqueeze(1)
        delta = (dout_g * _grouped(out[sq], num_kv)).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, sq].reshape(num_kv, -1, sq.stop - sq.start, 1)
        dscores = probs * (dout_g @ vv.transpose(-1, -2) - delta)
        if capped is not None:
            dscores = dscores * (1 - capped * capped)
        dv[sk] = (probs.transpose(-1, -2) @ dout_g).sum(1).permute(1, 0, 2).to(v.dtype)
        dq[sq] = (_ungrouped(dscores @ kk) * scale).to(q.dtype)
        dk_doc = (dscores.transpose(-1, -2) @ _grouped(q[sq], num_kv)).sum(1) * scale
        dk[sk] = dk_doc.permute(1, 0, 2).to(k.dtype)
    return dq, dk, dv


_FORWARD = {
    "cpu_flash": _cpu_flash_fwd,
    "torch_flash": _torch_flash_fwd,
    "cuda_flash": _cuda_flash_fwd,
    "flex": _flex_fwd,
    "npu_fusion": _npu_fwd,
    "composed": _composed_fwd,
}
_BACKWARD = {
    "cpu_flash": _cpu_flash_bwd,
    "torch_flash": _torch_flash_bwd,
    "cuda_flash": _cuda_flash_bwd,
    "flex": _flex_bwd,
    "npu_fusion": _npu_bwd,
    "composed": _composed_bwd,
}
assert set(_FORWARD) == set(_BACKWARD) == set(KERNELS)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


__all__ = [
    "KERNELS",
    "NO_WINDOW",
    "allowed",
    "backward",
    "default_scale",
    "flex_module",
    "forward",
    "varlen_arguments",
]
