"""linear: x @ weight^T (+ bias), for fp32/bf16 weights or int8 weights with a scale per
output, with a CPU kernel for the few-row products of decoding.

A decode step multiplies one to a few dozen token rows by every weight. oneDNN/MKL's GEMM is
built for many rows: on a 2-core AMD EPYC it streams an fp32 weight at about a third of the
memory's read bandwidth at one row, and PyTorch's int8 weight-only kernel
(`torch._weight_int8pack_mm`) reads 1-2 GB/s. Our C++ kernel (`csrc/fused_ops.cpp`,
`skinny_linear`) streams each weight row once and takes its dot products with a tile of x
rows in fp32; `benchmarks/ops.py --ops linear` measures it against `F.linear`.

The kernel runs only where it is the faster one and no gradient is needed: CPU with the AVX2
build, inference (no input needs a gradient), at most `SKINNY_MAX_ROWS` rows for fp32 and
int8 weights and one row for bf16 (from two rows on, oneDNN's bf16 dot product instructions
win). Everything else, training included, is `F.linear`: the library GEMM on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import needs_grad, plain_tensors, resolve_impl
from mindspeed_ops.dtensor import is_dtensor
from mindspeed_ops.validate import check_float, check_same_device, check_tensor

SKINNY_MAX_ROWS = 64  # fp32 / int8 weights: above it oneDNN's GEMM blocks better
_BF16_MAX_ROWS = 1  # bf16 weights: from two rows on oneDNN's avx512_bf16 dot products win


def linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """The oracle: F.linear, with an int8 weight dequantised as weight * scale[:, None]."""
    if scale is None:
        return F.linear(x, weight, bias)
    out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


@torch.library.custom_op("mindspeed::skinny_linear", mutates_args=())
def _skinny_linear(x: Tensor, weight: Tensor, scale: Tensor | None) -> Tensor:
    """x (rows, in) fp32/bf16, weight (out, in) contiguous fp32/bf16/int8, scale (out,) fp32."""
    empty = scale if scale is not None else x.new_empty(0, dtype=torch.float32)
    return cpu_ext.load().skinny_linear(x, weight, empty)


@_skinny_linear.register_fake
def _(x, weight, scale):
    return x.new_empty(x.shape[0], weight.shape[0])


def _skinny_applies(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> bool:
    if weight.dtype == torch.int8 or weight.dtype == torch.float32:
        limit = SKINNY_MAX_ROWS
    elif weight.dtype == torch.bfloat16:
        limit = _BF16_MAX_ROWS
    else:
        return False
    if rows > limit or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not plain_tensors(x, weight, bias):
        return False  # subclasses need the dispatcher (see backends.plain_tensors)
    if weight.dtype != torch.int8 and weight.dtype != x.dtype:
        return False  # F.linear's own error, or autocast's casts
    if torch.is_autocast_enabled(x.device.type):
        return False  # autocast decides the dtype of the product: F.linear
    if needs_grad(x, weight, bias):
        return False  # training: the kernel has no backward
    return weight.is_contiguous() and _kernel_built()


@torch.compiler.assume_constant_result  # a fact of the build: compiled code need not ask
def _kernel_built() -> bool:
    if not _BUILT:
        ext = cpu_ext.load()
        _BUILT.append(ext is not None and bool(ext.skinny_linear_simd()))
    return _BUILT[0]


_NO_SCALE = torch.empty(0)
_BUILT: list[bool] = []  # filled once: whether the C++ kernels have their AVX2 skinny_linear


def _validate(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None) -> None:
    check_float("x", x)
    check_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's in_features {weight.shape[1]}, "
            f"got x shape {tuple(x.shape)}"
        )
    check_same_device("weight", weight, x)
    if weight.dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 weight needs scale (one per output channel)")
    elif scale is not None:
        raise ValueError("scale goes with an int8 weight only")
    if scale is not None:
        check_float("scale", scale)
        check_same_device("scale", scale, x)
        if tuple(scale.shape) != (weight.shape[0],):
            raise ValueError(
                f"scale must have shape ({weight.shape[0]},), got {tuple(scale.shape)}"
            )
    if bias is not None:
        check_float("bias", bias)
        check_same_device("bias", bias, x)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    scale: Tensor | None = None,
    impl: str = "auto",
) -> Tensor:
    """x @ weight^T (* scale) (+ bias), in x's dtype.

    Args:
        x: (..., in_features), fp32 or bf16 for the CPU kernel (any float dtype otherwise).
        weight: (out_features, in_features): x's dtype (or any, under autocast), or int8
            with `scale`.
        bias: (out_features,) or None.
        scale: (out_features,) float, with an int8 weight only: the weight is weight * scale.
        impl: "auto", "reference", "cpu", "cuda" or "npu". "cpu" runs the few-row kernel
            where it applies (see the module docstring) and oneDNN's GEMM elsewhere; the
            accelerators run F.linear (cuBLAS, aclnn).
    """
    _validate(x, weight, bias, scale)
    if is_dtensor(x) or is_dtensor(weight):  # tensor parallel: DTensor's own linear
        return linear_reference(x, weight, bias, scale)
    backend = resolve_impl(impl, x)
    in_features, out_features = weight.shape[1], weight.shape[0]
    rows = x.numel() // in_features if in_features else 0
    if backend == "cpu" and rows > 0 and _skinny_applies(x, weight, bias, rows):
        if scale is not None and scale.dtype != torch.float32:
            scale = scale.float()
        flat = x.reshape(rows, in_features)
        if torch.compiler.is_compiling():
            out = _skinny_linear(flat, weight, scale)  # opaque to the compiler, with a fake
        else:  # eager: skip the custom op's dispatch, ~10 us a call, ~10% of a decode step
            empty = scale if scale is not None else _NO_SCALE
            out = cpu_ext.load().skinny_linear(flat, weight, empty)
        out = out.view(*x.shape[:-1], out_features)
        return out if bias is None else out + bias
    return linear_reference(x, weight, bias, scale)
