"""Which attention kernel runs a call: a table of what each kernel supports.

Each kernel of `attention_kernels` answers `supports(case) -> None | reason` for a `Case`
(device, dtype, head sizes, window, soft cap, offsets); per device `PREFERENCE` lists them
fastest first, and the first that takes the case runs it (`dispatch`). `choose` logs once per
case which kernel runs and why each faster one was refused (every call with
MINDSPEED_ATTENTION_DEBUG=1).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mindspeed_ops import attention_kernels as kernels

__all__ = ["PREFERENCE", "RECOMPUTING", "SUPPORTS", "Case", "choose", "dispatch", "from_statistics"]

logger = logging.getLogger("mindspeed.ops.attention")


class Case(NamedTuple):
    """What decides which kernel can run a call (a named tuple: torch.compile traces it)."""

    device: str
    """"cpu", "cuda" or "npu"."""
    dtype: torch.dtype
    head_dim: int
    """Of the queries and keys."""
    v_dim: int
    """Of the values."""
    window: int
    """kernels.NO_WINDOW or the sliding window's length."""
    softcap: float
    """0.0: none."""
    offsets: bool
    """Per-document query offsets are given (context parallel's ring chunks)."""

    @classmethod
    def of(cls, device: str, q: Tensor, v: Tensor, window: int, softcap: float, offsets) -> Case:
        return cls(device, q.dtype, q.shape[-1], v.shape[-1], window, softcap, offsets is not None)


def _on(case: Case, device: str) -> str | None:
    return None if case.device == device else f"runs on {device.upper()} only"


def _supports_cpu_flash(case: Case) -> str | None:
    if (why := _on(case, "cpu")) is not None:
        return why
    if case.dtype == torch.float64:
        return "takes fp32, bf16 or fp16, not fp64"
    return None if kernels.cpu_ext.available() else "our C++ kernels are not built on this machine"


def _supports_torch_flash(case: Case) -> str | None:
    if (why := _on(case, "cpu")) is not None:
        return why
    if case.softcap or case.offsets:
        return "takes no soft cap and no query offsets"
    if case.window != kernels.NO_WINDOW:
        return "takes no sliding window"
    return None if case.v_dim == case.head_dim else "takes values only as wide as the keys"


def _supports_cuda_flash(case: Case) -> str | None:
    if (why := _on(case, "cuda")) is not None:
        return why
    if case.softcap or case.offsets:
        return "takes no soft cap and no query offsets"
    if case.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16 or bf16, not {str(case.dtype).removeprefix('torch.')}"
    if case.head_dim > 256 or case.head_dim % 8:
        return f"takes heads of at most 256 channels, a multiple of 8 (not {case.head_dim})"
    if case.v_dim > case.head_dim:
        return "takes values at most as wide as the keys"
    if "window_size" not in kernels.varlen_arguments():
        return "needs torch >= 2.11 (varlen attention with a window)"
    return None


def _supports_flex(case: Case) -> str | None:
    # torch's flex_attention lowers only heads of at least 16 channels (seen on an H200,
    # torch 2.11: "NYI: embedding dimension ... must be at least 16"), and its decoding
    # kernel found no config for 20 channels with 8 query heads on one kv head and 17
    # queries: multiples of 16 only.
    if (why := _on(case, "cuda")) is not None:
        return why
    if not all(d >= 16 and d % 16 == 0 for d in (case.head_dim, case.v_dim)):
        return f"takes heads of a multiple of 16 channels (not {case.head_dim}/{case.v_dim})"
    return (
        None
        if kernels.flex_module() is not None
        else "FlexAttention is not available in this torch"
    )


def _supports_npu_fusion(case: Case) -> str | None:
    if (why := _on(case, "npu")) is not None:
        return why
    if case.softcap or case.offsets:
        return "takes no soft cap and no query offsets"
    return None if case.v_dim == case.head_dim else "takes values only as wide as the keys"


SUPPORTS: dict[str, Callable[[Case], str | None]] = {
    "cpu_flash": _supports_cpu_flash,
    "torch_flash": _supports_torch_flash,
    "cuda_flash": _supports_cuda_flash,
    "flex": _supports_flex,
    "npu_fusion": _supports_npu_fusion,
    "composed": lambda case: None,
}
"""Per kernel: `supports(case)` -> None (it runs the case) or why it cannot."""

PREFERENCE = {
    "cpu": ("cpu_flash", "torch_flash", "composed"),
    "cuda": ("cuda_flash", "flex", "composed"),
    "npu": ("npu_fusion", "composed"),
}
"""Per device, the kernels fastest first; the first that supports a case runs it."""

_explained: set[tuple[Case, str]] = set()


def dispatch(case: Case) -> tuple[str, dict[str, str]]:
    """The kernel for `case` and why each faster one was refused."""
    refused: dict[str, str] = {}
    for name in PREFERENCE.get(case.device, ("composed",)):
        why = SUPPORTS[name](case)
        if why is None:
            return name, refused
        refused[name] = why
    return "composed", refused


def choose(device: str, q: Tensor, v: Tensor, window: int, softcap: float, offsets) -> str:
    """The kernel for a call on `device` ("cpu", "cuda" or "npu"), logged once per case with
    the reason each faster kernel was refused (info when one was, else debug; every call at
    info with MINDSPEED_ATTENTION_DEBUG=1)."""
    case = Case.of(device, q, v, window, softcap, offsets)
    kernel, refused = dispatch(case)
    if not torch.compiler.is_compiling():
        every = os.environ.get("MINDSPEED_ATTENTION_DEBUG", "") not in ("", "0")
        if every or (case, kernel) not in _explained:
            _explained.add((case, kernel))
            why = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
            # a fall-back is worth a line; the fastest kernel running says so at debug level
            logger.log(logging.INFO if every or refused else logging.DEBUG,
                       "attention %s %s, heads %d/%d, window %d, softcap %g, offsets %s: %s%s",
                       case.device, str(case.dtype).removeprefix("torch."), case.head_dim, case.v_dim,
                       case.window, case.softcap, case.offsets, kernel,
                       f" (refused: {why})" if why else "")  # fmt: skip
    return kernel


RECOMPUTING = ("flex", "npu_fusion")
"""Kernels whose backward recomputes the forward and ignores the given out and lse: right
only for their own forward's statistics, so a backward from merged ones (context parallel's
ring blocks, attention sinks) takes the composed kernel instead."""


def from_statistics(kernel: str) -> str:
    """The kernel whose backward honours given (merged) out and lse, for `kernel`."""
    return "composed" if kernel in RECOMPUTING else kernel
