"""linear: the few-row CPU kernel against F.linear, the fallbacks, and the bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindspeed_ops as mo
from mindspeed_ops import cpu_ext
from mindspeed_ops.linear import SKINNY_MAX_ROWS, _skinny_applies


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _int8(weight):
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


needs_kernel = pytest.mark.skipif(
    cpu_ext.load() is None or not cpu_ext.load().skinny_linear_simd(),
    reason="the C++ kernels' AVX2 build is not available",
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, SKINNY_MAX_ROWS])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_kernel_equals_reference(rows, kind):
    # in 37 and out 23 leave a tail after the 8-wide loads and the 3-row tiles
    x, weight, bias = _g(rows, 37), _g(23, 37, seed=1), _g(23, seed=2)
    scale = None
    if kind == "bf16":
        x, weight, bias = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
        x = x[:1]  # bf16 takes the kernel at one row only
    if kind == "int8":
        weight, scale = _int8(weight)
    with torch.no_grad():
        assert _skinny_applies(x, weight, bias, x.shape[0])
        got = mo.linear(x, weight, bias, scale=scale, impl="cpu")
        # the oracle in fp64: both sides are then within their own rounding of it
        want = (
            F.linear(
                x.double(), weight.double() * (1 if scale is None else scale.double()[:, None])
            )
            + bias.double()
        )
    assert got.dtype == x.dtype and got.shape == (x.shape[0], 23)
    tol = {"fp32": 1e-5, "int8": 1e-5, "bf16": 1e-2}[kind]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@needs_kernel
def test_kernel_runs_for_decoding_shapes_and_not_for_training():
    weight = _g(16, 8)
    x = _g(2, 1, 8)  # (batch, one new token, hidden)
    with torch.no_grad():
        out = mo.linear(x, weight)
    assert out.shape == (2, 1, 16)
    torch.testing.assert_close(out, x @ weight.t(), atol=1e-6, rtol=1e-6)
    trained = weight.clone().requires_grad_()
    assert not _skinny_applies(x, trained, None, 2)  # needs a gradient: F.linear
    assert not _skinny_applies(_g(SKINNY_MAX_ROWS + 1, 8), weight, None, SKINNY_MAX_ROWS + 1)
    assert not _skinny_applies(x.bfloat16(), weight.bfloat16(), None, 2)
    assert not _skinny_applies(x, weight.t().contiguous().t(), None, 2)  # strided weight
    y = mo.linear(x, trained)  # the fallback keeps autograd
    y.sum().backward()
    torch.testing.assert_close(trained.grad, x.reshape(2, 8).sum(0).expand(16, 8))


@needs_kernel
def test_autocast_decides_the_dtype():
    # bf16 autocast with fp32 weights (mixed-precision training and eval): F.linear's casts
    x, weight = _g(1, 16), _g(8, 16, seed=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _skinny_applies(x, weight, None, 1)
        got, want = mo.linear(x, weight), F.linear(x, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(RuntimeError):  # mixed dtypes without autocast: F.linear's own error
        mo.linear(x, weight.double())


def test_int8_reference_and_many_rows():
    weight, scale = _int8(_g(12, 40, seed=3))
    x = _g(SKINNY_MAX_ROWS * 2, 40)  # past the kernel: the dequantised GEMM
    with torch.no_grad():
        got = mo.linear(x, weight, scale=scale)
    torch.testing.assert_close(got, x @ (weight.float() * scale[:, None]).t(), atol=1e-5, rtol=1e-5)


def test_compiles_without_a_graph_break():
    weight = _g(24, 16)
    x = _g(1, 16)
    counts = torch._dynamo.utils.counters
    counts.clear()
    with torch.no_grad():
        compiled = torch.compile(lambda a: mo.linear(a, weight), fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), x @ weight.t(), atol=1e-6, rtol=1e-6)
    assert not counts["graph_break"]


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((_g(2, 8), _g(4, 7)), {}, ValueError, "in_features 7"),
        ((_g(2, 8), _g(4, 8, 1)), {}, ValueError, "must be 2-D"),
        ((_g(2, 8), _g(4, 8).to(torch.int8)), {}, ValueError, "needs scale"),
        ((_g(2, 8), _g(4, 8).to(torch.int8)), {"scale": _g(3)}, ValueError, r"shape \(4,\)"),
        ((_g(2, 8), _g(4, 8)), {"scale": _g(4)}, ValueError, "int8 weight only"),
        ((_g(2, 8), _g(4, 8), _g(5)), {}, ValueError, "bias must have shape"),
    ],
)
def test_bad_inputs_are_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        mo.linear(*args, **kwargs)
