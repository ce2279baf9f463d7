"""Causal attention with soft-capped scores (Gemma 2), in plain PyTorch.

scores = cap * tanh(q k^T * scale / cap), then the causal (and sliding-window) mask, softmax
in fp32, times v. The fused `mindspeed_ops.attention` has no soft-capping, so a model with
`attn_logit_softcapping` runs this path: O(seq^2) memory per head, every backend, tensor
parallel (local heads), not context parallel.
"""

from __future__ import annotations

import torch
from torch import Tensor


def softcapped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softcap: float,
    scale: float,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Soft-capped causal attention, grouped-query (kv head h serves query heads
    h * group .. (h + 1) * group - 1).

    Args:
        q, k, v: (batch, seq, heads, head_dim), or packed (tokens, heads, head_dim) with
            `cu_seqlens` (int32 document boundaries over the tokens).
        window: each query sees only the last `window` keys, itself included.

    Returns:
        The shape of q, its dtype.
    """
    if cu_seqlens is None:
        return torch.stack(
            [_segment(q[b], k[b], v[b], softcap, scale, window) for b in range(q.shape[0])]
        )
    bounds = cu_seqlens.tolist()
    return torch.cat(
        [
            _segment(q[a:b], k[a:b], v[a:b], softcap, scale, window)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )


def _segment(q: Tensor, k: Tensor, v: Tensor, softcap: float, scale: float, window: int | None):
    """One document: (seq, heads, head_dim) each."""
    seq, heads, _ = q.shape
    group = heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
