"""Input checks shared by the ops: a clear TypeError/ValueError before any kernel runs."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from mindspeed_ops.backends import is_fake

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


def on_host(t: Tensor) -> bool:
    """Whether `t`'s values sit in host memory, so that reading them costs no device sync: a
    CPU tensor, not a fake one (FakeTensorMode has shapes and no values)."""
    return t.device.type == "cpu" and not is_fake(t)


def check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """cu_seqlens: 1-D, starts at 0, non-decreasing, ends at `total` tokens."""
    check_index("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    if not eager():
        return
    values = host_values(cu_seqlens)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in pairwise(values)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the packed input has {total} tokens")


_HOST_VALUES = WeakIdKeyDictionary()


def host_values(t: Tensor) -> list[int] | int:
    """An index tensor's values as a Python list (a number for a 0-d tensor), read from the
    device once per tensor.

    Reading a GPU tensor waits for everything queued before it. The packed-document
    boundaries (cu_seqlens) are one tensor that every layer's attention reads, forward and
    backward, to check it and to size the flash kernel; read each time, that is a few
    device-wide stalls per layer per step, and the host stops queueing work ahead of the GPU
    (an H200's packed Llama-1B step: 0.82x -> 0.835x transformers' tokens/s without them). So
    the list is remembered for the tensor object, and read again only if the tensor was
    written in place since (its version counter). Inference tensors have no version counter:
    they are read every time."""
    if t.is_inference():
        return t.tolist()
    hit = _HOST_VALUES.get(t)
    if hit is not None and hit[0] == t._version:
        return hit[1]
    values = t.tolist()
    _HOST_VALUES[t] = (t._version, values)
    return values


def remember_host_values(t: Tensor, values: list[int] | int | None = None) -> Tensor:
    """Have `host_values(t)` answer without reading `t`: `values` (the Python list `t` was
    made from) or, by default, `t`'s own values, read now. Called on host tensors (a training
    step's document boundaries before it moves them, `mindspeed_llm.data.collate.to_device`),
    whose device copies then get the values with `carry_host_values`: the kernels that need
    them on the host never wait for the device to read them back. Returns `t`."""
    if not t.is_inference():
        _HOST_VALUES[t] = (t._version, t.tolist() if values is None else values)
    return t


def carry_host_values(src: Tensor, dst: Tensor) -> Tensor:
    """`dst`, a copy of `src` (on another device), remembered with `src`'s host values when
    `src` has them (`remember_host_values`); no tensor is read. Returns `dst`."""
    hit = None if src.is_inference() else _HOST_VALUES.get(src)
    if hit is not None and hit[0] == src._version and dst is not src and not dst.is_inference():
        _HOST_VALUES[dst] = (dst._version, hit[1])
    return dst
