"""cross_entropy and linear_cross_entropy: chunked kernels against torch's cross entropy."""

from __future__ import annotations

import pytest
import torch

import mindspeed_ops as mo

# Losses are fp32 in both paths; the chunked sums differ only in order. In bf16 the logits
# (or, for the fused variant, the bf16 matmul per chunk) are the same on both sides.
LOSS_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _target(tokens, vocab):
    """Random classes with every third token (from the second on) ignored."""
    t = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(5))
    t[1::3] = -100
    return t


CASES = [
    # (tokens, vocab, label_smoothing, reduction, chunk_size)
    (1, 7, 0.0, "mean", None),  # a single token (not ignored)
    (37, 1001, 0.0, "mean", 8),  # uneven last chunk
    (20, 333, 0.1, "sum", 6),
    (13, 50, 0.25, "none", 5),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cross_entropy_parity(parity, backend, dtype, case):
    tokens, vocab, smoothing, reduction, chunk = case
    target = _target(tokens, vocab).to(backend)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    parity(
        lambda logits: mo.cross_entropy(logits, target, **kw, chunk_size=chunk, impl=backend),
        lambda logits: mo.cross_entropy_reference(logits, target, **kw),
        {"logits": _g(tokens, vocab) * 3}, dtype, backend, LOSS_TOL[dtype],
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_linear_cross_entropy_parity(parity, backend, dtype, case):
    tokens, vocab, smoothing, reduction, chunk = case
    target = _target(tokens, vocab).to(backend)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    parity(
        lambda hidden, weight: mo.linear_cross_entropy(
            hidden, weight, target, **kw, chunk_size=chunk, impl=backend
        ),
        lambda hidden, weight: mo.linear_cross_entropy_reference(hidden, weight, target, **kw),
        {"hidden": _g(tokens, 24), "weight": _g(vocab, 24, seed=1) * 0.3},
        dtype, backend, LOSS_TOL[dtype],
    )  # fmt: skip


def test_cross_entropy_custom_ignore_index():
    logits = _g(6, 10)
    target = torch.tensor([1, 7, 7, 2, 7, 3])
    got = mo.cross_entropy(logits, target, ignore_index=7, impl="cpu")
    want = torch.nn.functional.cross_entropy(logits[[0, 3, 5]], target[[0, 3, 5]])
    torch.testing.assert_close(got, want)


def test_cross_entropy_non_contiguous_logits(parity, backend):
    target = _target(9, 40).to(backend)
    parity(
        lambda base: mo.cross_entropy(base.t(), target, chunk_size=4, impl=backend),
        lambda base: mo.cross_entropy_reference(base.t(), target),
        {"base": _g(40, 9)}, torch.float32, backend,
    )  # fmt: skip
