"""attention: every backend against the reference, fwd and bwd (including through lse)."""

from __future__ import annotations

import math

import pytest
import torch

import mindspeed_ops as mo

# Attention sums over keys in a different order than the reference (and SDPA uses its own
# kernel), so fp32 gets a looser bound than the pointwise ops.
ATTN_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qkv(lead, heads_q, heads_kv, dim):
    return {"q": _g(*lead, heads_q, dim), "k": _g(*lead, heads_kv, dim, seed=1),
            "v": _g(*lead, heads_kv, dim, seed=2)}  # fmt: skip


BATCHED = [
    # (batch, seq, heads_q, heads_kv, head_dim, causal, window, return_lse)
    (2, 9, 4, 4, 8, True, None, False),  # GQA ratio 1, SDPA path
    (1, 1, 4, 1, 8, True, None, False),  # a single token, MQA
    (2, 13, 8, 2, 12, True, None, True),  # GQA 4 with lse
    (1, 17, 8, 1, 20, False, None, True),  # GQA 8, bidirectional
    (2, 16, 4, 2, 8, True, 5, False),  # sliding window
    (1, 12, 2, 2, 8, False, 3, True),  # bidirectional window
]


@pytest.mark.parametrize("case", BATCHED, ids=str)
def test_attention_batched_parity(parity, backend, dtype, case):
    batch, seq, hq, hkv, dim, causal, window, lse = case
    kwargs = dict(causal=causal, window=window)

    def ours(q, k, v):
        return mo.attention(q, k, v, **kwargs, return_lse=lse, impl=backend)

    def ref(q, k, v):
        out, s = mo.attention_reference(q, k, v, **kwargs)
        return (out, s) if lse else out

    parity(ours, ref, _qkv((batch, seq), hq, hkv, dim), dtype, backend, ATTN_TOL[dtype])


PACKED = [
    # (cu_seqlens, heads_q, heads_kv, head_dim, causal, window, softcap, v_head_dim)
    ([0, 3, 4, 11, 11, 20], 4, 1, 8, True, None, None, 8),  # uneven, length 1, an empty one
    ([0, 7, 19], 8, 2, 6, True, 4, None, 6),
    ([0, 5, 10], 4, 4, 16, False, None, None, 16),
    ([0, 9, 30], 4, 2, 8, True, 6, 20.0, 8),  # Gemma 2: window and soft cap
    ([0, 12, 25], 4, 4, 12, True, None, None, 8),  # latent attention: narrower values
]


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_attention_packed_parity(parity, backend, dtype, case):
    # Through the custom op and its autograd, gradients through lse included.
    cu, hq, hkv, dim, causal, window, softcap, dv = case
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=backend)
    kwargs = dict(causal=causal, window=window, cu_seqlens=cu_seqlens, softcap=softcap)
    inputs = _qkv((cu[-1],), hq, hkv, dim)
    inputs["v"] = inputs["v"][..., :dv].contiguous()
    parity(
        lambda q, k, v: mo.attention(q, k, v, **kwargs, return_lse=True, impl=backend),
        lambda q, k, v: mo.attention_reference(q, k, v, **kwargs),
        inputs, dtype, backend, ATTN_TOL[dtype],
    )  # fmt: skip


def test_attention_long_sequence(parity, backend):
    # seq 4097 with tiny heads: the composed kernel and SDPA path both against the reference.
    inputs = _qkv((1, 4097), 2, 1, 4)
    for lse in (False, True):
        parity(
            lambda q, k, v, lse=lse: mo.attention(q, k, v, return_lse=lse, impl=backend),
            lambda q, k, v, lse=lse: mo.attention_reference(q, k, v)[: 2 if lse else 1],
            inputs, torch.float32, backend, ATTN_TOL[torch.float32],
        )  # fmt: skip


def test_packed_equals_separate_sequences():
    q, k, v = _qkv((10,), 4, 2, 8).values()
    cu = torch.tensor([0, 6, 10])
    out, lse = mo.attention(q, k, v, cu_seqlens=cu, return_lse=True, impl="cpu")
    second, second_lse = mo.attention(q[None, 6:], k[None, 6:], v[None, 6:], return_lse=True,
                                      impl="cpu")  # fmt: skip
    torch.testing.assert_close(out[6:], second[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[:, 6:], second_lse[0], atol=1e-6, rtol=1e-6)


def test_lse_merges_two_key_halves():
    # Context parallel's merge: attention over all keys from two partial results and their lse.
    q, k, v = _qkv((1, 8), 2, 2, 4).values()
    full = mo.attention(q, k, v, causal=False, impl="cpu")
    parts = [
        mo.attention_reference(q, k[:, s], v[:, s], causal=False)
        for s in (slice(0, 4), slice(4, 8))
    ]
    lse = torch.logaddexp(parts[0][1], parts[1][1])  # (batch, heads, seq)
    merged = sum(o * torch.exp(s - lse).transpose(1, 2)[..., None] for o, s in parts)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def test_single_key_softmax_is_identity():
    # The first query under a causal mask sees one key: out = v[0], lse = q.k * scale.
    q, k, v = _qkv((1, 3), 1, 1, 4).values()
    out, lse = mo.attention(q, k, v, return_lse=True, impl="cpu")
    torch.testing.assert_close(out[0, 0], v[0, 0])
    torch.testing.assert_close(lse[0, 0, 0], (q[0, 0, 0] @ k[0, 0, 0]) / math.sqrt(4))


@pytest.mark.parametrize("lse", [False, True], ids=["sdpa", "composed"])
def test_attention_non_contiguous(parity, backend, lse):
    # q, k, v as (batch, heads, seq, dim) buffers viewed as (batch, seq, heads, dim).
    inputs = {"q": _g(2, 4, 9, 8), "k": _g(2, 2, 9, 8, seed=1), "v": _g(2, 2, 9, 8, seed=2)}

    def ours(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return mo.attention(q, k, v, return_lse=lse, impl=backend)

    def ref(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out, s = mo.attention_reference(q, k, v)
        return (out, s) if lse else out

    parity(ours, ref, inputs, torch.float32, backend, ATTN_TOL[torch.float32])
