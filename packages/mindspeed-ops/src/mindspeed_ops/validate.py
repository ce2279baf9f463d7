"""Input checks shared by the ops: a clear TypeError/ValueError before any kernel runs."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_float(name: str, t: Tensor) -> None:
    check_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating point tensor, got dtype {t.dtype}")


def check_index(name: str, t: Tensor) -> None:
    check_tensor(name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {t.dtype}")


def check_same_device(name: str, t: Tensor, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but the input is on {ref.device}")


def check_same_dtype(name: str, t: Tensor, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the input has {ref.dtype}")


def eager() -> bool:
    """False while torch.compile traces: data-dependent checks (values, not shapes) are skipped
    there; the kernels still check them."""
    return not torch.compiler.is_compiling()


def check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """cu_seqlens: 1-D, starts at 0, non-decreasing, ends at `total` tokens."""
    check_index("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    if not eager():
        return
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in pairwise(values)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the packed input has {total} tokens")
