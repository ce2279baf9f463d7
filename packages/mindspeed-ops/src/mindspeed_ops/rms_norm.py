"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, every step in fp32, y in x's dtype.

`offset=True` is the Gemma style, y = x_hat * (1 + w), for weights stored around zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import eager_inference, has_module, resolve_impl, warn_once
from mindspeed_ops.dtensor import is_dtensor, run_rowwise
from mindspeed_ops.validate import check_float, check_same_device

_CPP_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_reference(
    x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, offset: bool = False
) -> Tensor:
    """The oracle: plain PyTorch, differentiable by autograd."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        y = y * (w + 1.0 if offset else w)
    return y.to(x.dtype)


def _effective_weight(weight: Tensor | None, offset: bool) -> Tensor | None:
    if weight is None:
        return None
    return weight.float() + 1.0 if offset else weight


def _fwd_torch(x: Tensor, w: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd[:, None]
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype), rstd


def _bwd_torch(dy: Tensor, x: Tensor, w: Tensor | None, rstd: Tensor) -> tuple[Tensor, Tensor]:
    xhat = x.float() * rstd[:, None]
    dyf = dy.float()
    g = dyf * w.float() if w is not None else dyf
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).sum(0) if w is not None else x.new_empty(0, dtype=torch.float32)
    return dx.to(x.dtype), dw


def _use_cpp(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _CPP_DTYPES and cpu_ext.load() is not None


def _rms_norm_fwd_body(
    x: Tensor, weight: Tensor | None, eps: float, offset: bool
) -> tuple[Tensor, Tensor]:
    """x: (rows, hidden) contiguous -> (y, rstd fp32 (rows,))."""
    w = _effective_weight(weight, offset)
    if _use_cpp(x):
        y, rstd = cpu_ext.load().rms_norm_fwd(x, w, eps)
        return y, rstd
    return _fwd_torch(x, w, eps)


_rms_norm_fwd = torch.library.custom_op("mindspeed::rms_norm_fwd", mutates_args=())(
    _rms_norm_fwd_body
)


@_rms_norm_fwd.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("mindspeed::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: bool
) -> tuple[Tensor, Tensor]:
    """-> (dx, dweight in fp32; empty when there is no weight)."""
    w = _effective_weight(weight, offset)
    if _use_cpp(x):
        out = cpu_ext.load().rms_norm_bwd(dy, x, w, rstd)
        return out[0], (out[1] if w is not None else x.new_empty(0, dtype=torch.float32))
    return _bwd_torch(dy, x, w, rstd)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset):
    dw_shape = (x.shape[1],) if weight is not None else (0,)
    return torch.empty_like(x), x.new_empty(dw_shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd(dy.contiguous(), x, weight, rstd, ctx.offset)
    return dx, (dw.to(weight.dtype) if weight is not None else None), None, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: bool = False,
    impl: str = "auto",
) -> Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape).

    Args:
        x: input, float32/bfloat16 (float16/float64 run the composed path).
        weight: optional (hidden,) scale.
        eps: added to the mean square.
        offset: scale by (1 + weight) instead of weight.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight is not None:
        check_float("weight", weight)
        check_same_device("weight", weight, x)
        if tuple(weight.shape) != (hidden,):
            raise ValueError(f"weight shape {tuple(weight.shape)} != (hidden,) = ({hidden},)")
    if is_dtensor(x):

        def local(x_local: Tensor, w_local: Tensor | None) -> Tensor:
            return rms_norm(x_local, w_local, eps, offset=offset, impl=impl)

        return run_rowwise("rms_norm", local, x, params=(weight,))
    backend = resolve_impl(impl, x)
    if backend == "reference":
        return rms_norm_reference(x, weight, eps, offset)
    if backend == "npu":
        return _rms_norm_npu(x, weight, eps, offset)
    if backend == "cuda":
        if has_module("liger_kernel"):
            return _rms_norm_liger(x, weight, eps, offset)
        if impl == "cuda":
            warn_once(
                "rms_norm_cuda",
                "rms_norm: liger-kernel not installed, impl='cuda' runs "
                "the composed PyTorch kernel",
            )
        # The composed kernel as plain aten ops, differentiated by autograd: wrapped in the
        # custom op it cost the same kernels plus the op's Python dispatch and backward on
        # the host, and torch.compile could not fuse into it.
        return rms_norm_reference(x, weight, eps, offset)
    fwd = _rms_norm_fwd_body if eager_inference(x, weight) else _rms_norm_fwd
    y, _ = fwd(x.reshape(-1, hidden).contiguous(), weight, float(eps), offset)
    return y.view(x.shape)


def _rms_norm_liger(x: Tensor, weight: Tensor | None, eps: float, offset: bool) -> Tensor:
    from liger_kernel.transformers.functional import liger_rms_norm

    if weight is None:
        weight = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
        offset = False
    # "gemma" casting keeps every step in fp32, matching the reference.
    return liger_rms_norm(x, weight, eps, offset=1.0 if offset else 0.0, casting_mode="gemma")


def _rms_norm_npu(x: Tensor, weight: Tensor | None, eps: float, offset: bool) -> Tensor:
    import torch_npu

    if weight is None:
        gamma = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
    else:
        gamma = weight + 1.0 if offset else weight
    return torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]
