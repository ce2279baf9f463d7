"""NF4 against torchao (the oracle): torchao's own quantiser, given the same 16 levels, gives
our codes and absmax bit for bit; with its rounded table (to_nf4) only values on a decision
boundary may differ. The C++ kernel equals the reference; storage is 0.28x bf16."""

import pytest
import torch

import mindspeed_ops as mo
from mindspeed_ops import cpu_ext

# One block of 8 (absmax 2), by hand: value / 2 = -1, 1, 0, 0.0796, 0.7230, -0.6962 (levels
# 0, 15, 7, 8, 14, 1), 0.25 (nearest 0.2461: 10), -0.005 (nearest 0: 7).
GOLDEN = torch.tensor([-2.0, 2.0, 0.0, 0.1591605, 1.4459137, -1.3923856, 0.5, -0.01])
GOLDEN_CODES = [0, 15, 7, 8, 14, 1, 10, 7]


def _codes(packed):
    return torch.stack([packed >> 4, packed & 15], 1).flatten().tolist()


def _weights(dtype=torch.float32):
    return (torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)


def test_golden_codes_and_roundtrip():
    packed, absmax = mo.nf4_quantize_reference(GOLDEN, block_size=8)
    assert absmax.tolist() == [2.0]
    codes = _codes(packed)
    assert codes == GOLDEN_CODES
    levels = torch.tensor(mo.NF4_LEVELS)
    back = mo.nf4_dequantize_reference(packed, absmax, (8,), torch.float32, block_size=8)
    assert torch.equal(back, levels[codes] * 2)


@pytest.mark.skipif(cpu_ext.compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernel_equals_the_reference(in_dtype):
    w = _weights(in_dtype)
    packed, absmax = mo.nf4_quantize(w, impl="cpu")
    ref_packed, ref_absmax = mo.nf4_quantize_reference(w)
    assert torch.equal(packed, ref_packed) and torch.equal(absmax, ref_absmax)
    for out in (torch.float32, torch.bfloat16):
        got = mo.nf4_dequantize(packed, absmax, w.shape, dtype=out, impl="cpu")
        assert torch.equal(got, mo.nf4_dequantize_reference(packed, absmax, w.shape, out))
    zero = torch.zeros(64, dtype=in_dtype)
    assert (
        _codes(mo.nf4_quantize(zero)[0]) == [7] * 64 == _codes(mo.nf4_quantize_reference(zero)[0])
    )


def test_codes_equal_torchao():
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    w = _weights()
    packed, absmax = mo.nf4_quantize(w)
    levels = torch.tensor(mo.NF4_LEVELS)
    theirs = nf4_tensor.NF4Tensor.convert_to_norm_float_weight(w, w.numel() // 64, 64, levels)
    assert torch.equal(theirs, packed)
    assert torch.equal(nf4_tensor.get_block_absmax(w.flatten(), 64), absmax)
    # to_nf4 rounds the levels to 4 decimals: codes agree except on a decision boundary.
    rounded = nf4_tensor.to_nf4(w, 64, 256).quantized_data
    scaled = (w.view(-1, 64) / absmax[:, None]).flatten()
    bounds = (levels[1:] + levels[:-1]) / 2
    near = (scaled[:, None] - bounds).abs().min(dim=1).values < 1e-4
    differ = torch.tensor(_codes(rounded)) != torch.tensor(_codes(packed))
    assert not (differ & ~near).any() and differ.sum() < 0.001 * w.numel()


def test_storage_is_under_0_3x_bf16():
    w = _weights(torch.bfloat16)
    packed, absmax = mo.nf4_quantize(w)
    ratio = (packed.nbytes + absmax.nbytes) / w.nbytes
    assert ratio == pytest.approx(0.28125) and ratio <= 0.3


def test_bad_input():
    with pytest.raises(ValueError, match="block_size=64 does not divide x's 100 values"):
        mo.nf4_quantize(torch.randn(100))
    with pytest.raises(TypeError, match="floating"):
        mo.nf4_quantize(torch.ones(64, dtype=torch.int32))
    packed, absmax = mo.nf4_quantize(torch.randn(128))
    with pytest.raises(ValueError, match="do not hold shape"):
        mo.nf4_dequantize(packed, absmax, (64,))
