"""The measured side of the estimator: peak device memory of one training step.

On accelerators: the caching allocator's `max_memory_allocated` over the step. On CPU there
is no allocator statistic, so the step runs under `torch.profiler` with
`profile_memory=True`: the CPU allocator itself reports every allocation and free to the
profiler (public API), with the running total of bytes allocated since profiling began.
The peak is the bytes alive when the step starts (the storages of the tensors passed in:
parameters, buffers, optimizer states) plus the highest running total. Unlike a
dispatch-level tracker (torch.distributed._tools.mem_tracker, a private API), this sees
the temporaries inside custom ops and C++ kernels too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mindspeed_core import device as dev


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_tensors(modules: Iterable[torch.nn.Module], optimizers: Iterable) -> list[torch.Tensor]:
    """Parameters, buffers and optimizer states: what lives across steps."""
    out = []
    for m in modules:
        out += list(m.parameters()) + list(m.buffers())
    for opt in optimizers:
        for state in opt.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
    return out


def measure_peak(step: Callable[[], None], device: torch.device, persistent: Iterable[torch.Tensor]) -> int:
    """Peak bytes on `device` while `step()` runs; `persistent` are the tensors alive
    before it (only their bytes are needed on CPU)."""
    if device.type != "cpu":
        dev.synchronize(device)
        dev.reset_peak_memory(device)
        step()
        dev.synchronize(device)
        return int(dev.memory_stats(device)["peak_gb"] * 2**30)
    from torch.profiler import ProfilerActivity, profile

    baseline = live_bytes(persistent)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return baseline + _max_total_allocated(prof)


def _max_total_allocated(prof) -> int:
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)
