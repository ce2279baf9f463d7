"""Rotary position embedding with explicit position ids (packed sequences restart at 0).

x is (batch, seq, heads, head_dim) or packed (tokens, heads, head_dim). The tables cos/sin are
(max_positions, rot_dim // 2); `rot_dim <= head_dim`, the dimensions after it pass through.
Layouts: rotate-half (GPT-NeoX/Llama: pairs i and i + rot_dim/2) or interleaved (GPT-J: pairs
2i and 2i + 1). The tables are constants: they get no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import eager_inference, resolve_impl
from mindspeed_ops.validate import (
    check_float,
    check_index,
    check_same_device,
    host_values,
    on_host,
)

_CPP_DTYPES = (torch.float32, torch.bfloat16)


def rotary_tables(
    rot_dim: int,
    max_positions: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """fp32 (max_positions, rot_dim // 2) cos and sin tables for inverse frequencies base^(-2i/d)."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, device=device, dtype=torch.float64) / rot_dim)
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def position_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Positions that restart at 0 at every packed sequence boundary."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = host_values(cu_seqlens)[-1]  # remembered by data code: no device read
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def _rotate(x: Tensor, c: Tensor, s: Tensor, interleaved: bool) -> Tensor:
    """x: (..., heads, rot_dim) fp32; c, s: (..., 1, rot_dim // 2)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotary_reference(
    x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, interleaved: bool = False
) -> Tensor:
    """The oracle. position_ids has x's leading shape (all dims but the last two)."""
    half = cos.shape[-1]
    c = cos.float()[position_ids].unsqueeze(-2)
    s = sin.float()[position_ids].unsqueeze(-2)
    xf = x.float()
    out = _rotate(xf[..., : 2 * half], c, s, interleaved)
    return torch.cat([out, xf[..., 2 * half :]], dim=-1).to(x.dtype)


def _rotary_composed(
    x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool
) -> Tensor:
    """The reference's math in plain aten ops, without its copy of the channels RoPE leaves
    alone when it turns every channel (the eager CUDA path: each op is a kernel launch)."""
    if 2 * cos.shape[-1] != x.shape[-1]:
        return rotary_reference(x, cos, sin, positions, interleaved)
    c = cos.float()[positions].unsqueeze(-2)
    s = sin.float()[positions].unsqueeze(-2)
    return _rotate(x.float(), c, s, interleaved).to(x.dtype)


def _rotary_body(
    x: Tensor, position_ids: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool
) -> Tensor:
    """x (tokens, heads, head_dim) contiguous; position_ids (tokens,) int64; fp32 tables.
    The C++ kernel checks the positions against the tables (ValueError); the composed
    fallback checks them here, on host tensors only (where reading them costs no sync)."""
    if x.device.type == "cpu" and x.dtype in _CPP_DTYPES and cpu_ext.load() is not None:
        return cpu_ext.load().rotary(x, position_ids, cos, sin, interleaved, inverse)
    if on_host(position_ids):
        _check_positions(position_ids, cos.shape[0])
    return rotary_reference(x, cos, -sin if inverse else sin, position_ids, interleaved)


def _check_positions(positions: Tensor, table: int) -> None:
    """Positions inside the tables. Checked where it costs no device sync: on host tensors
    (out-of-range positions on an accelerator fail in its indexing, as they do in torch's own
    embedding lookup)."""
    if positions.numel() > 0:
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= table:
            raise ValueError(f"position_ids must lie in [0, {table}) (the table length), "
                             f"got values from {low} to {high}")  # fmt: skip


_rotary = torch.library.custom_op("mindspeed::rotary", mutates_args=())(_rotary_body)


@_rotary.register_fake
def _(x, position_ids, cos, sin, interleaved, inverse):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _x, position_ids, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(position_ids, cos, sin)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _backward(ctx, dy):
    position_ids, cos, sin = ctx.saved_tensors
    dx = _rotary(dy.contiguous(), position_ids, cos, sin, ctx.interleaved, not ctx.inverse)
    return dx, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


def _normalise_positions(x: Tensor, position_ids: Tensor | None) -> Tensor:
    """position_ids broadcast to x's leading shape, int64."""
    lead = x.shape[:-2]
    if position_ids is None:
        seq_dim = len(lead) - 1
        return torch.arange(lead[seq_dim], device=x.device).expand(lead)
    check_index("position_ids", position_ids)
    check_same_device("position_ids", position_ids, x)
    shape = tuple(position_ids.shape)
    if shape != tuple(lead) and shape != tuple(lead[-1:]):
        raise ValueError(
            f"position_ids shape {shape} must be {tuple(lead)} or {tuple(lead[-1:])} "
            f"for x of shape {tuple(x.shape)}"
        )
    positions = position_ids.long()
    return positions if positions.shape == lead else positions.expand(lead)


def _validate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> None:
    check_float("x", x)
    if x.dim() not in (3, 4):
        raise ValueError(
            "x must be (batch, seq, heads, head_dim) or (tokens, heads, head_dim), "
            f"got shape {tuple(x.shape)}"
        )
    check_float("cos", cos)
    check_float("sin", sin)
    check_same_device("cos", cos, x)
    check_same_device("sin", sin, x)
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must both be (max_positions, rot_dim // 2), got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"rot_dim {2 * cos.shape[1]} exceeds head_dim {x.shape[-1]}")


def rotary_embedding(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    *,
    interleaved: bool = False,
    impl: str = "auto",
) -> Tensor:
    """Rotate the first rot_dim = 2 * cos.shape[-1] channels of every head of `x`.

    Args:
        x: (batch, seq, heads, head_dim) or packed (tokens, heads, head_dim).
        cos, sin: (max_positions, rot_dim // 2) tables, e.g. from `rotary_tables`.
        position_ids: (batch, seq) or (seq,) for batched x, (tokens,) for packed x
            (`position_ids_from_cu_seqlens` gives positions restarting at 0 per sequence);
            default: 0..seq-1.
        interleaved: GPT-J pairs (2i, 2i+1) instead of rotate-half.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    positions = _normalise_positions(x, position_ids)
    _validate(x, cos, sin, positions, interleaved)
    backend = resolve_impl(impl, x)
    if backend == "reference":
        return rotary_reference(x, cos, sin, positions, interleaved)
    if backend == "cuda":
        # No CUDA library matches this API (liger's rope takes q and k together, rotate-half
        # only); the composed math compiles well with inductor.
        return _rotary_composed(x, cos, sin, positions, interleaved)
    if backend == "npu":
        return _rotary_npu(x, cos, sin, positions, interleaved)
    flat = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    op = _rotary_body if eager_inference(x, positions, cos, sin) else _rotary
    out = op(
        flat,
        positions.reshape(-1).contiguous(),
        cos.float().contiguous(),
        sin.float().contiguous(),
        interleaved,
        False,
    )
    return out.view(x.shape)


def _rotary_npu(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool):
    import torch_npu

    half = cos.shape[-1]
    if interleaved or 2 * half != x.shape[-1]:
        return rotary_reference(x, cos, sin, positions, interleaved)
    # npu_rotary_mul wants full-width (…, 1, head_dim) tables in rotate-half layout.
    c = torch.cat([cos, cos], -1)[positions].unsqueeze(-2).to(x.dtype)
    s = torch.cat([sin, sin], -1)[positions].unsqueeze(-2).to(x.dtype)
    return torch_npu.npu_rotary_mul(x, c, s)
