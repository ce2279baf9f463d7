"""Which implementation of an op runs: `impl="auto" | "reference" | "cpu" | "cuda" | "npu"`.

The ops package imports nothing of ours, so it detects devices itself, exactly as
`mindspeed_core.device` does (npu_available, cuda_available): torch_npu counts only when
it is installed, imports and sees a device. Keep the two copies in step;
integration_tests/test_workspace.py checks they agree.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from functools import cache

import torch
from torch._subclasses.fake_tensor import is_fake as is_fake_tensor

IMPLS = ("auto", "reference", "cpu", "cuda", "npu")
BACKENDS = ("reference", "cpu", "cuda", "npu")


@cache
def npu_available() -> bool:
    """True when torch_npu is installed and sees at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception:  # a broken CANN install must not break CPU/GPU users
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def cuda_available() -> bool:
    """True when PyTorch sees at least one CUDA device."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


OPTIONAL = ("liger_kernel", "fla", "tilelang", "flash_attn")
"""The optional kernel libraries the CUDA paths look for."""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Looked up once, here: the CUDA paths of rms_norm, swiglu and gated_delta_rule ask from inside
# compiled blocks, where a dict read is a constant but importlib is not (dynamo refuses to
# trace find_spec on torch 2.11: a fullgraph block failed to compile on an H200).
_FOUND = {name: _importable(name) for name in OPTIONAL}


def has_module(name: str) -> bool:
    """Whether an optional library (liger_kernel, fla, torch_npu ...) is importable."""
    return _FOUND[name] if name in _FOUND else _importable(name)


def available_impls() -> list[str]:
    """The implementations that can run in this process."""
    found = ["reference", "cpu"]
    if cuda_available():
        found.append("cuda")
    if npu_available():
        found.append("npu")
    return found


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(map(repr, IMPLS))}")


def resolve_impl(impl: str, tensor: torch.Tensor) -> str:
    """The concrete backend for `impl` on `tensor`'s device.

    "auto" picks the backend of the tensor's device ("cpu", "cuda", "npu"; the reference on
    any other device). An explicit backend must match the device.
    """
    check_impl(impl)
    device = tensor.device.type
    if impl == "auto":
        return device if device in ("cpu", "cuda", "npu") else "reference"
    if impl != "reference" and impl != device and not is_fake(tensor):
        raise ValueError(f"impl={impl!r} cannot run on a tensor on device {device!r}")
    return impl


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a FakeTensor (shapes and dtypes, no data): any backend's path may
    run on one, which is how `benchmarks/host_overhead.py` measures the host work of the
    accelerator paths on a machine without the accelerator. Its values cannot be read."""
    return is_fake_tensor(tensor)


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per key and process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def eager_inference(*tensors: torch.Tensor | None) -> bool:
    """True in eager code where none of `tensors` needs a gradient. An op may then call its
    kernel's Python body directly instead of through its torch.library custom op, whose
    dispatch (~10 us a call) only autograd and torch.compile need: in a CPU decode step that
    dispatch was a tenth of the time."""
    if torch.compiler.is_compiling():
        return False
    return plain_tensors(*tensors) and not needs_grad(*tensors)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will want a gradient through an op on `tensors`."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def plain_tensors(*tensors: torch.Tensor | None) -> bool:
    """Whether each of `tensors` is a plain tensor or parameter, not a subclass: a kernel called
    without the dispatcher would read a subclass's storage directly, and some have none yet
    (tensor parallel's AsyncCollectiveTensor before its wait)."""
    return all(t is None or type(t) in _PLAIN for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
