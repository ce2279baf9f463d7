"""SwiGLU: silu(a) * b, on two tensors or on one tensor holding [a; b] on its last dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import eager_inference, has_module, resolve_impl, warn_once
from mindspeed_ops.dtensor import is_dtensor, run_rowwise
from mindspeed_ops.validate import check_float, check_same_device, check_same_dtype

_CPP_DTYPES = (torch.float32, torch.bfloat16)


def swiglu_reference(x: Tensor, y: Tensor | None = None) -> Tensor:
    """The oracle: silu(a) * b in fp32, returned in the input dtype."""
    a, b = x.chunk(2, dim=-1) if y is None else (x, y)
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def _use_cpp(t: Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _CPP_DTYPES and cpu_ext.load() is not None


def _fwd(a: Tensor, b: Tensor) -> Tensor:
    if _use_cpp(a):
        return cpu_ext.load().swiglu_fwd(a, b)
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def _bwd_into(dy: Tensor, a: Tensor, b: Tensor, da: Tensor, db: Tensor) -> None:
    if _use_cpp(a):
        cpu_ext.load().swiglu_bwd(dy, a, b, da, db)
        return
    af, bf, dyf = a.float(), b.float(), dy.float()
    s = torch.sigmoid(af)
    da.copy_(dyf * bf * s * (1 + af * (1 - s)))
    db.copy_(dyf * af * s)


# Two tensors: a, b are (rows, hidden) with a unit inner stride.
_swiglu_fwd = torch.library.custom_op("mindspeed::swiglu_fwd", mutates_args=())(_fwd)


@_swiglu_fwd.register_fake
def _(a, b):
    return a.new_empty(a.shape)


@torch.library.custom_op("mindspeed::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    da, db = a.new_empty(a.shape), b.new_empty(b.shape)
    _bwd_into(dy, a, b, da, db)
    return da, db


@_swiglu_bwd.register_fake
def _(dy, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_two(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_two(ctx, dy):
    a, b = ctx.saved_tensors
    return _swiglu_bwd(dy.contiguous(), a, b)


_swiglu_fwd.register_autograd(_backward_two, setup_context=_setup_two)


# One tensor: x is (rows, 2 * hidden) contiguous, a = x[:, :hidden], b = x[:, hidden:].
def _fused_fwd(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return _fwd(a, b)


_swiglu_fused_fwd = torch.library.custom_op("mindspeed::swiglu_fused_fwd", mutates_args=())(
    _fused_fwd
)


@_swiglu_fused_fwd.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("mindspeed::swiglu_fused_bwd", mutates_args=())
def _swiglu_fused_bwd(dy: Tensor, x: Tensor) -> Tensor:
    dx = torch.empty_like(x)
    a, b = x.chunk(2, dim=-1)
    da, db = dx.chunk(2, dim=-1)
    _bwd_into(dy, a, b, da, db)
    return dx


@_swiglu_fused_bwd.register_fake
def _(dy, x):
    return torch.empty_like(x)


def _setup_fused(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward_fused(ctx, dy):
    (x,) = ctx.saved_tensors
    return _swiglu_fused_bwd(dy.contiguous(), x)


_swiglu_fused_fwd.register_autograd(_backward_fused, setup_context=_setup_fused)


def _validate(x: Tensor, y: Tensor | None) -> None:
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if y is None:
        if x.shape[-1] % 2:
            raise ValueError(f"fused swiglu needs an even last dimension, got {x.shape[-1]}")
        return
    check_float("y", y)
    check_same_device("y", y, x)
    check_same_dtype("y", y, x)
    if x.shape != y.shape:
        raise ValueError(f"x shape {tuple(x.shape)} != y shape {tuple(y.shape)}")


def swiglu(x: Tensor, y: Tensor | None = None, *, impl: str = "auto") -> Tensor:
    """silu(a) * b.

    Args:
        x: `a`, or with `y=None` the fused tensor [a; b] split in halves on its last dim.
        y: `b`, same shape and dtype as `x`.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    _validate(x, y)
    if is_dtensor(x):
        rows_like = () if y is None else (y,)
        return run_rowwise("swiglu", lambda *t: swiglu(*t, impl=impl), x, rows_like=rows_like)
    backend = resolve_impl(impl, x)
    if backend == "reference":
        return swiglu_reference(x, y)
    if backend == "npu":
        import torch_npu

        return torch_npu.npu_swiglu(x if y is None else torch.cat([x, y], -1), dim=-1)
    if backend == "cuda":
        if has_module("liger_kernel"):
            from liger_kernel.transformers.functional import liger_swiglu

            a, b = x.chunk(2, dim=-1) if y is None else (x, y)
            return liger_swiglu(a.contiguous(), b.contiguous())
        if impl == "cuda":
            warn_once(
                "swiglu_cuda",
                "swiglu: liger-kernel not installed, impl='cuda' runs the composed PyTorch kernel",
            )
        return swiglu_reference(x, y)  # plain aten ops (see rms_norm's CUDA path)
    direct = eager_inference(x, y)  # the kernel without its custom op's dispatch
    if y is None:
        hidden2 = x.shape[-1]
        fused = _fused_fwd if direct else _swiglu_fused_fwd
        out = fused(x.reshape(-1, hidden2).contiguous())
        return out.view(*x.shape[:-1], hidden2 // 2)
    hidden = x.shape[-1]
    two = _fwd if direct else _swiglu_fwd
    out = two(x.reshape(-1, hidden).contiguous(), y.reshape(-1, hidden).contiguous())
    return out.view(x.shape)
