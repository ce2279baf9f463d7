"""Weight-gradient accumulation: main_grad += grad_output^T @ input, in fp32, in place.

This is what a linear layer's backward does when the weight keeps an fp32 `main_grad` next
to low-precision parameters (Megatron's gradient accumulation fusion). It is called from a
backward, so it has no autograd of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_ops.backends import resolve_impl
from mindspeed_ops.validate import check_float, check_same_device

_CHUNK_ROWS = 4096  # tokens cast to fp32 at once


def matmul_add_reference(grad_output: Tensor, input: Tensor, main_grad: Tensor) -> Tensor:
    """The oracle, out of place: main_grad + grad_output^T @ input in fp32."""
    dy = grad_output.reshape(-1, grad_output.shape[-1]).float()
    x = input.reshape(-1, input.shape[-1]).float()
    return main_grad + dy.t() @ x


@torch.library.custom_op("mindspeed::matmul_add", mutates_args=("main_grad",))
def _matmul_add(grad_output: Tensor, input: Tensor, main_grad: Tensor) -> None:
    """grad_output (tokens, out), input (tokens, in), main_grad fp32 (out, in)."""
    if grad_output.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), input)
        return
    # Low precision: cast a bounded number of rows at a time so the fp32 copies stay small.
    for a in range(0, grad_output.shape[0], _CHUNK_ROWS):
        dy = grad_output[a : a + _CHUNK_ROWS].float()
        main_grad.addmm_(dy.t(), input[a : a + _CHUNK_ROWS].float())


@_matmul_add.register_fake
def _(grad_output, input, main_grad):
    return None


def matmul_add(
    grad_output: Tensor, input: Tensor, main_grad: Tensor, *, impl: str = "auto"
) -> Tensor:
    """Accumulate grad_output^T @ input into the fp32 `main_grad` (in place) and return it.

    Args:
        grad_output: (..., out_features).
        input: (..., in_features), same leading shape and dtype as grad_output.
        main_grad: fp32 (out_features, in_features).
        impl: "auto", "reference" (out of place), "cpu", "cuda" or "npu".
    """
    check_float("grad_output", grad_output)
    check_float("input", input)
    check_float("main_grad", main_grad)
    check_same_device("input", input, grad_output)
    check_same_device("main_grad", main_grad, grad_output)
    if input.dtype != grad_output.dtype:
        raise TypeError(f"input has dtype {input.dtype} but grad_output has {grad_output.dtype}")
    if main_grad.dtype != torch.float32:
        raise TypeError(f"main_grad must be float32, got {main_grad.dtype}")
    if grad_output.shape[:-1] != input.shape[:-1]:
        raise ValueError(
            f"grad_output {tuple(grad_output.shape)} and input {tuple(input.shape)} must share "
            "their leading (token) dims"
        )
    expected = (grad_output.shape[-1], input.shape[-1])
    if tuple(main_grad.shape) != expected:
        raise ValueError(f"main_grad shape {tuple(main_grad.shape)} != {expected}")
    backend = resolve_impl(impl, grad_output)
    if backend == "reference":
        return matmul_add_reference(grad_output, input, main_grad)
    _matmul_add(
        grad_output.reshape(-1, expected[0]).contiguous(),
        input.reshape(-1, expected[1]).contiguous(),
        main_grad,
    )
    return main_grad
