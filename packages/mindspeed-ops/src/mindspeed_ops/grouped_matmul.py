"""Grouped GEMM for MoE: tokens sorted by expert, one GEMM per expert from the token counts.

x (tokens, in_features) holds group 0's rows, then group 1's, ...; weight is
(groups, in_features, out_features); group_sizes (groups,) sums to the token count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_ops.backends import resolve_impl
from mindspeed_ops.validate import check_float, check_index, check_same_device, eager


def grouped_matmul_reference(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """The oracle: a Python loop over groups, differentiable by autograd."""
    pieces = torch.split(x, group_sizes.tolist())
    outs = [p @ weight[g] for g, p in enumerate(pieces)]
    return torch.cat(outs) if outs else x.new_empty(0, weight.shape[2])


def _bounds(group_sizes: Tensor) -> list[tuple[int, int, int]]:
    """(group, start, end) for the non-empty groups."""
    found, start = [], 0
    for g, n in enumerate(group_sizes.tolist()):
        if n:
            found.append((g, start, start + n))
        start += n
    return found


@torch.library.custom_op("mindspeed::grouped_matmul_fwd", mutates_args=())
def _gmm_fwd(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[2])
    for g, a, b in _bounds(group_sizes):
        torch.mm(x[a:b], weight[g], out=out[a:b])
    return out


@_gmm_fwd.register_fake
def _(x, weight, group_sizes):
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("mindspeed::grouped_matmul_bwd", mutates_args=())
def _gmm_bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor) -> tuple[Tensor, Tensor]:
    dx = torch.zeros_like(x)
    dw = torch.zeros_like(weight)
    for g, a, b in _bounds(group_sizes):
        torch.mm(dy[a:b], weight[g].t(), out=dx[a:b])
        torch.mm(x[a:b].t(), dy[a:b], out=dw[g])
    return dx, dw


@_gmm_bwd.register_fake
def _(dy, x, weight, group_sizes):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, weight, group_sizes = ctx.saved_tensors
    dx, dw = _gmm_bwd(dy.contiguous(), x, weight, group_sizes)
    return dx, dw, None


_gmm_fwd.register_autograd(_backward, setup_context=_setup_context)


def _validate(x: Tensor, weight: Tensor, group_sizes: Tensor) -> None:
    check_float("x", x)
    check_float("weight", weight)
    check_index("group_sizes", group_sizes)
    check_same_device("weight", weight, x)
    if x.dtype != weight.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} must be (tokens, in) and weight {tuple(weight.shape)} "
            "(groups, in, out)"
        )
    if tuple(group_sizes.shape) != (weight.shape[0],):
        raise ValueError(
            f"group_sizes shape {tuple(group_sizes.shape)} != ({weight.shape[0]},) groups"
        )
    if eager():
        sizes = group_sizes.tolist()
        if min(sizes, default=0) < 0 or sum(sizes) != x.shape[0]:
            raise ValueError(
                f"group_sizes {sizes} must be non-negative and sum to {x.shape[0]} tokens"
            )


def grouped_matmul(x: Tensor, weight: Tensor, group_sizes: Tensor, *, impl: str = "auto") -> Tensor:
    """out[rows of group g] = x[rows of group g] @ weight[g].

    Args:
        x: (tokens, in_features), rows sorted by group.
        weight: (groups, in_features, out_features).
        group_sizes: (groups,) int token counts (on any device; read on the host).
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    _validate(x, weight, group_sizes)
    backend = resolve_impl(impl, x)
    if backend == "reference":
        return grouped_matmul_reference(x, weight, group_sizes)
    if backend == "npu":
        import torch_npu

        # group_list_type=1: counts per group (not cumulative); split_item=2: one output.
        return torch_npu.npu_grouped_matmul(
            [x], [weight], group_list=group_sizes.long(), split_item=2, group_type=0,
            group_list_type=1,
        )[0]  # fmt: skip
    return _gmm_fwd(x.contiguous(), weight.contiguous(), group_sizes)
