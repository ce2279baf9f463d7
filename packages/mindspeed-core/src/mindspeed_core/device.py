"""Which accelerator this process runs on, and the few things we ask of it.

Every device-specific call in MindSpeed goes through this module; elsewhere the
code only holds a `torch.device` and a backend name.

Detection order for `auto`: an Ascend NPU (torch_npu importable and a device
present), then CUDA, then CPU. `MINDSPEED_DEVICE=cpu|cuda|npu|auto` or an
explicit argument overrides it. torch_npu is imported only when it is installed
and only from here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import resource
import sys
import time
from functools import cache

import torch

from mindspeed_core.errors import DeviceError

DEVICE_ENV_VAR = "MINDSPEED_DEVICE"
DEVICE_TYPES = ("cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_GIB = 1024**3


# mindspeed_ops.backends repeats npu_available/cuda_available (ops imports nothing of
# ours); keep the two in step: integration_tests/test_workspace.py checks they agree.
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


def is_available(device_type: str) -> bool:
    """Whether `device_type` ("cpu", "cuda" or "npu") can be used here."""
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return cuda_available()
    if device_type == "npu":
        return npu_available()
    return False


def detect_device_type(override: str | None = None) -> str:
    """The device type to use: `override`, else $MINDSPEED_DEVICE, else the best available.

    Raises:
        DeviceError: the requested type is unknown or not available here.
    """
    source = "device"
    choice = override
    if not choice:
        choice, source = os.environ.get(DEVICE_ENV_VAR, ""), DEVICE_ENV_VAR
    choice = (choice or "auto").strip().lower()
    if choice == "auto":
        return next(t for t in ("npu", "cuda", "cpu") if is_available(t))
    if choice not in DEVICE_TYPES:
        raise DeviceError(
            f"{source}={choice!r} is not a device type; choose one of auto, {', '.join(DEVICE_TYPES)}"
        )
    if not is_available(choice):
        raise DeviceError(f"{source}={choice!r} was requested but no {choice} device is available")
    return choice


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for a device type: gloo, nccl or hccl."""
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise DeviceError(f"no process-group backend for device type {device_type!r}") from None


def device_count(device_type: str) -> int:
    """Number of devices of this type on the node (1 for CPU)."""
    if device_type == "cpu":
        return 1
    if not is_available(device_type):
        return 0
    return torch.get_device_module(device_type).device_count()


def device_name(device_type: str) -> str:
    """A human-readable name of device 0 (the processor model for CPU)."""
    if device_type == "cpu":
        return _cpu_name()
    return torch.get_device_module(device_type).get_device_name(0)


def get_device(local_rank: int = 0, device_type: str | None = None) -> torch.device:
    """The device of this process, made current for accelerators.

    Raises:
        DeviceError: `local_rank` has no device on this node.
    """
    device_type = device_type or detect_device_type()
    if device_type == "cpu":
        return torch.device("cpu")
    count = device_count(device_type)
    if not 0 <= local_rank < count:
        raise DeviceError(
            f"LOCAL_RANK={local_rank} but this node has {count} {device_type} device(s); "
            f"launch at most {count} processes per node"
        )
    device = torch.device(device_type, local_rank)
    torch.get_device_module(device_type).set_device(device)
    return device


def prefers_fused_optimizer(device_type: str) -> bool:
    """Whether torch's fused AdamW is the fast choice on this device type (CUDA)."""
    return device_type == "cuda"


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory use in GiB: allocated, reserved and peak allocated.

    On CPU there is no allocator to ask; the peak is the process's maximum
    resident set size and the other two are reported as that too.
    """
    if device.type == "cpu":
        peak = _max_rss_gib()
        return {"allocated_gb": peak, "reserved_gb": peak, "peak_gb": peak}
    module = torch.get_device_module(device.type)
    return {
        "allocated_gb": module.memory_allocated(device) / _GIB,
        "reserved_gb": module.memory_reserved(device) / _GIB,
        "peak_gb": module.max_memory_allocated(device) / _GIB,
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (accelerators only; CPU keeps the process peak)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).reset_peak_memory_stats(device)


# Dense bf16/fp16 tensor-core peaks from the vendors' data sheets, by device-name substring.
_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("V100", 125e12),
)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak matmul FLOP/s of one device, for MFU.

    Known accelerators come from a data-sheet table (bf16/fp16); anything else (a
    CPU, an NPU or an unknown GPU) is measured once with a short matmul probe and
    cached for the life of the process.
    """
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = device_name("cuda")
        for key, value in _PEAK_BF16:
            if key in name:
                return value
    return _measured_peak(device.type, device.index, dtype)


@cache
def _measured_peak(device_type: str, index: int | None, dtype: torch.dtype) -> float:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    n = 1024 if device_type == "cpu" else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm up (thread pools, kernel selection)
    synchronize(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _max_rss_gib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / _GIB if sys.platform == "darwin" else rss / 1024**2


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def profiler_activities(device_type: str) -> list:
    """torch.profiler activities for a device type: the CPU, plus its kernels."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif device_type == "npu":  # torch_npu registers as PrivateUse1 (untested here)
        activities.append(ProfilerActivity.PrivateUse1)
    return activities


def record_memory_history(device: torch.device, enabled: bool) -> bool:
    """Start or stop the allocator's history for memory snapshots; False where the device
    keeps none (CPU)."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(enabled="all" if enabled else None)
    return True


def dump_memory_snapshot(device: torch.device, path) -> bool:
    """Write the allocator history (pytorch.org/memory_viz format); False where none."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._dump_snapshot(str(path))
    return True


def new_stream(device: torch.device):
    """A side stream for copies that overlap compute; None on CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).Stream(device=device)


def copy_on_stream(dst: torch.Tensor, src: torch.Tensor, stream) -> object | None:
    """dst.copy_(src) on `stream` once the current stream has produced `src`; returns the
    copy's completion event (None on CPU, where the copy is done on return)."""
    if stream is None:
        dst.copy_(src)
        return None
    module = torch.get_device_module(stream.device.type)
    stream.wait_stream(module.current_stream(stream.device))
    with module.stream(stream):
        dst.copy_(src, non_blocking=True)
    for t in (src, dst):  # neither may be reused by the allocator before the copy ends
        if t.device.type != "cpu":
            t.record_stream(stream)
    return stream.record_event()


def wait_event(event, device: torch.device) -> None:
    """Make the current stream of `device` wait for `event` (from `copy_on_stream`)."""
    if event is not None:
        torch.get_device_module(device.type).current_stream(device).wait_event(event)
