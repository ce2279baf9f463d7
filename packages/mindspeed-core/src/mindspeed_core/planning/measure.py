"""The measured side of the estimator: peak device memory of one training step.

On accelerators: the caching allocator's `max_memory_allocated` over the step. On CPU there
is no allocator statistic, so the whole run (model building included) goes under
`torch.profiler` with `profile_memory=True`: the CPU allocator itself reports every
allocation and free to the profiler (public API) with the running total of bytes allocated
since profiling began. Started before anything is built, that total is the process's live
tensor memory; the peak of a step is its highest value inside the step's window. Unlike a
dispatch-level tracker (torch.distributed._tools.mem_tracker, a private API) this also
sees temporaries inside custom ops and C++ kernels, and buffers no module owns (pipeline
receive buffers, communication buffers).

    probe = PeakProbe(device)
    with probe:
        model = build(); train_step()
        with probe.window():
            train_step()
    probe.peak  # bytes
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mindspeed_core import device as dev

_WINDOW = "mindspeed::measured_step"


class PeakProbe:
    """Peak live bytes on `device` inside `window()`, tracked from `__enter__` on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        self._prof = None

    def __enter__(self) -> PeakProbe:
        if self.device.type == "cpu":
            gc.collect()  # earlier objects freed now, not inside the window
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    @contextlib.contextmanager
    def window(self):
        if self.device.type != "cpu":
            dev.synchronize(self.device)
            dev.reset_peak_memory(self.device)
            yield
            dev.synchronize(self.device)
            self.peak = int(dev.memory_stats(self.device)["peak_gb"] * 2**30)
            return
        with record_function(_WINDOW):
            yield

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak = _peak_in_window(self._prof)


def _peak_in_window(prof) -> int:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    windows = [e for e in events if e.get("name") == _WINDOW and e.get("ph") == "X"]
    assert windows, "PeakProbe.window() was never entered"
    lo, hi = windows[-1]["ts"], windows[-1]["ts"] + windows[-1]["dur"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    # The allocator's running total is process-wide and also holds what earlier profiling
    # sessions allocated: count from its value when this session began.
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    inside = [e["args"]["Total Allocated"] for e in memory if lo <= e["ts"] <= hi]
    return max(inside, default=start) - start
