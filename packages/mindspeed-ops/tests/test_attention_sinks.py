"""Attention sinks (gpt-oss): a learned logit per query head in every row's softmax
denominator. The reference against transformers' gpt-oss eager attention (an oracle nobody
here wrote), then every backend against the reference, forward and backward (sinks' gradient
included, through lse too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mindspeed_ops as mo

transformers_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(lead, hq, hkv, dim, seed=0):
    return {"q": _g(*lead, hq, dim, seed=seed), "k": _g(*lead, hkv, dim, seed=seed + 1),
            "v": _g(*lead, hkv, dim, seed=seed + 2), "sinks": _g(hq, seed=seed + 3) * 2}  # fmt: skip


def _hf_attention(q, k, v, sinks, window=None):
    """transformers' gpt-oss eager attention on (batch, seq, heads, dim) inputs, causal
    (and windowed) through its additive mask."""
    seq = q.shape[1]
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
    mask = torch.zeros(seq, seq).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = nn.Module()
    module.sinks, module.training = sinks, False
    module.num_key_value_groups = q.shape[2] // k.shape[2]
    out, _ = transformers_gpt_oss.eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[None, None],
        scaling=q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_sinks_equal_transformers_gpt_oss(window):
    q, k, v, sinks = _inputs((2, 11), 8, 2, 16).values()
    want = _hf_attention(q, k, v, sinks, window)
    for impl in ("reference", "cpu"):
        got = mo.attention(q, k, v, window=window, sinks=sinks, impl=impl)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The sinks matter: without them the rows sum their weights to 1 and differ.
    plain = mo.attention(q, k, v, window=window, impl="cpu")
    assert (plain - want).abs().max() > 1e-2


CASES = [
    # (lead, cu_seqlens, heads_q, heads_kv, dim, causal, window, return_lse)
    ((2, 9), None, 4, 2, 8, True, None, False),  # batched: not the SDPA path with sinks
    ((20,), [0, 3, 4, 11, 11, 20], 4, 1, 8, True, None, True),  # packed, uneven, one empty
    ((19,), [0, 7, 19], 8, 2, 6, True, 4, True),  # window
    ((10,), [0, 5, 10], 4, 4, 16, False, None, False),  # bidirectional
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sinks_every_backend_matches_reference(parity, backend, dtype, case):
    lead, cu, hq, hkv, dim, causal, window, lse = case
    kwargs = dict(causal=causal, window=window)
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=backend)

    def ours(q, k, v, sinks):
        return mo.attention(q, k, v, **kwargs, sinks=sinks, return_lse=lse, impl=backend)

    def ref(q, k, v, sinks):
        out, s = mo.attention_reference(q, k, v, **kwargs, sinks=sinks)
        return (out, s) if lse else out

    parity(ours, ref, _inputs(lead, hq, hkv, dim), dtype, backend, TOL[dtype])


def test_sinks_by_hand_and_lse_includes_them():
    # Softmax over [scores, sink] with the sink column dropped, written out; the returned
    # lse is the log-sum-exp over the keys and the sink.
    q, k, v, sinks = _inputs((1, 6), 2, 2, 4).values()
    scores = torch.einsum("bshd,bthd->bhst", q, k) * 4**-0.5
    scores = torch.cat([scores, sinks[None, :, None, None].expand(1, 2, 6, 1)], -1)
    want = torch.einsum("bhst,bthd->bshd", scores.softmax(-1)[..., :-1], v)
    got, lse = mo.attention(q, k, v, causal=False, sinks=sinks, return_lse=True, impl="cpu")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-6, rtol=1e-5)


def test_bad_sinks_name_themselves():
    q, k, v, _ = _inputs((1, 4), 4, 2, 8).values()
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head \(4,\)"):
        mo.attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks"):
        mo.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long))
