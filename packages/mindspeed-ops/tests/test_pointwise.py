"""rms_norm, swiglu and rotary_embedding: every backend against the reference, fwd and bwd."""

from __future__ import annotations

import pytest
import torch

import mindspeed_ops as mo

# Hidden sizes that are not multiples of 16 (nor of the vector width), and a single token.
NORM_SHAPES = [(1, 1), (1, 37), (3, 5, 129), (4097, 24), (2, 3, 1000)]


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("style", ["weight", "offset", "none"])
def test_rms_norm_parity(parity, backend, dtype, shape, style):
    hidden = shape[-1]
    inputs = {"x": _g(*shape) * 3}
    if style != "none":
        inputs["weight"] = _g(hidden, seed=1)

    def ours(x, weight=None):
        return mo.rms_norm(x, weight, 1e-5, offset=style == "offset", impl=backend)

    def ref(x, weight=None):
        return mo.rms_norm_reference(x, weight, 1e-5, offset=style == "offset")

    parity(ours, ref, inputs, dtype, backend)


def test_rms_norm_non_contiguous(parity, backend, dtype):
    # The op reads every other column of a wider buffer; the gradient lands in the buffer.
    inputs = {"base": _g(7, 2 * 45), "weight": _g(45, seed=1)}
    parity(
        lambda base, weight: mo.rms_norm(base[:, ::2], weight, impl=backend),
        lambda base, weight: mo.rms_norm_reference(base[:, ::2], weight),
        inputs, dtype, backend,
    )  # fmt: skip


SWIGLU_SHAPES = [(1, 1), (1, 37), (3, 5, 129), (4097, 12), (2, 700)]


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two"])
def test_swiglu_parity(parity, backend, dtype, shape, fused):
    if fused:
        inputs = {"x": _g(*shape[:-1], 2 * shape[-1]) * 4}
        parity(lambda x: mo.swiglu(x, impl=backend), mo.swiglu_reference, inputs, dtype, backend)
    else:
        inputs = {"x": _g(*shape) * 4, "y": _g(*shape, seed=1)}
        parity(
            lambda x, y: mo.swiglu(x, y, impl=backend), mo.swiglu_reference, inputs, dtype,
            backend,
        )  # fmt: skip


def test_swiglu_non_contiguous_and_extremes(parity, backend):
    base = _g(6, 2, 66) * 4
    base[0, 0, :4] = torch.tensor([-200.0, 200.0, -60.0, 0.0])  # sigmoid saturation
    parity(
        lambda base: mo.swiglu(base.transpose(0, 1), impl=backend),
        lambda base: mo.swiglu_reference(base.transpose(0, 1)),
        {"base": base}, torch.float32, backend,
    )  # fmt: skip


ROPE_CASES = [
    # (x shape, rot_dim, position ids kind)
    ((2, 5, 3, 8), 8, "default"),
    ((1, 1, 1, 6), 6, "default"),  # a single token
    ((2, 7, 4, 34), 16, "batched"),  # partial rotary, head_dim not a multiple of 16
    ((4097, 1, 4), 4, "default"),  # packed layout, a long sequence
    ((11, 2, 20), 12, "packed"),  # packed sequences restarting at 0
]


def _positions(kind, shape):
    if kind == "default":
        return None
    if kind == "batched":
        return torch.stack([torch.arange(shape[1]) + 3, torch.arange(shape[1])])
    return mo.position_ids_from_cu_seqlens(torch.tensor([0, 4, 5, 11]))


@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_parity(parity, backend, dtype, case, interleaved):
    shape, rot_dim, kind = case
    cos, sin = mo.rotary_tables(rot_dim, 4200, device=backend)
    positions = _positions(kind, shape)
    positions = positions.to(backend) if positions is not None else None
    lead = shape[:-2]
    ref_positions = (
        positions.expand(lead) if positions is not None else torch.arange(lead[-1]).expand(lead)
    ).to(backend)

    parity(
        lambda x: mo.rotary_embedding(x, cos, sin, positions, interleaved=interleaved,
                                      impl=backend),
        lambda x: mo.rotary_reference(x, cos, sin, ref_positions, interleaved),
        {"x": _g(*shape)}, dtype, backend,
    )  # fmt: skip


def test_rotary_packed_restarts_at_zero():
    # Two packed sequences: the second must be rotated exactly as if it stood alone.
    cos, sin = mo.rotary_tables(8, 16)
    x = _g(9, 2, 8)
    cu = torch.tensor([0, 4, 9])
    packed = mo.rotary_embedding(x, cos, sin, mo.position_ids_from_cu_seqlens(cu), impl="cpu")
    alone = mo.rotary_embedding(x[4:], cos, sin, impl="cpu")
    torch.testing.assert_close(packed[4:], alone, atol=0, rtol=0)
    assert not torch.equal(packed[4:], mo.rotary_embedding(x, cos, sin, impl="cpu")[4:])


def test_rotary_half_matches_complex_rotation():
    # Independent oracle: rotate-half with full rotary equals multiplying by e^{i * angle}.
    cos, sin = mo.rotary_tables(4, 8)
    x = _g(1, 5, 1, 4)
    out = mo.rotary_embedding(x, cos, sin, impl="cpu")
    z = torch.complex(x[..., :2], x[..., 2:]) * torch.complex(cos[:5], sin[:5])[None, :, None]
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1), atol=1e-6, rtol=1e-6)


def test_rotary_non_contiguous(parity, backend, dtype):
    # k taken out of a fused qkv projection: a strided view, as in a real attention block.
    cos, sin = mo.rotary_tables(6, 16, device=backend)
    positions = torch.arange(5, device=backend).expand(2, 5)

    def split(qkv):
        return qkv[..., 24:36].unflatten(-1, (2, 6))

    parity(
        lambda qkv: mo.rotary_embedding(split(qkv), cos, sin, impl=backend),
        lambda qkv: mo.rotary_reference(split(qkv), cos, sin, positions),
        {"qkv": _g(2, 5, 48)}, dtype, backend,
    )  # fmt: skip
