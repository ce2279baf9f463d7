"""Shared helpers for the ops tests: which backends run here and a forward+backward parity check.

Every backend is compared with the reference (the oracle) on the same inputs: outputs, then
the gradients of sum(output * random cotangent) with respect to every float input.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_ops.backends import cuda_available, npu_available

# Tolerances (atol, rtol) per dtype. fp32 kernels reorder sums, so a few ulps; bf16 outputs are
# rounded once from fp32 in both paths, so about one bf16 ulp (2^-8 relative) plus slack.
TOLERANCES = {torch.float32: (1e-5, 1.3e-6 * 20), torch.bfloat16: (2e-2, 2e-2)}

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no GPU")],
    ),
    pytest.param(
        "npu",
        id="npu",
        marks=[pytest.mark.npu, pytest.mark.skipif(not npu_available(), reason="no NPU")],
    ),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _run(fn, inputs, dtype, device, seed):
    leaves = {
        name: t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()
        for name, t in inputs.items()
    }
    out = fn(**leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=gen).to(device)).sum()
        for o in outs
        if o.requires_grad
    )
    loss.backward()
    grads = {n: t.grad.float().cpu() for n, t in leaves.items() if t.grad is not None}
    return [o.detach().float().cpu() for o in outs], grads


def check_parity(ours, reference, inputs, dtype, device="cpu", tol=None, seed=0):
    """Run ours and reference on copies of `inputs` (name -> fp32 CPU tensor, all get grads)
    in `dtype` on `device`; assert outputs and input gradients agree within `tol`."""
    atol, rtol = tol or TOLERANCES[dtype]
    got, got_grads = _run(ours, inputs, dtype, device, seed)
    want, want_grads = _run(reference, inputs, dtype, device, seed)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m, i=i: f"out{i}: {m}")
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name in want_grads:
        torch.testing.assert_close(
            got_grads[name], want_grads[name], atol=atol, rtol=rtol,
            msg=lambda m, name=name: f"grad {name}: {m}",
        )  # fmt: skip


def pytest_generate_tests(metafunc):
    # Any test taking `backend` runs on every non-reference backend (skipped where absent);
    # any test taking `dtype` runs in fp32 and bf16.
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS)
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", DTYPES)


@pytest.fixture
def parity():
    return check_parity
