"""Fit a `Calibration` to measurements made on the machine at hand.

- compute: step times of single-rank runs at two micro-batch sizes, as many at once as the
  planned world has ranks (on a CPU they share the cores: this folds that in); the cost
  model's compute time is linear in (1 / FLOP/s, overhead per block), fitted by least
  squares;
- overheads of tensor parallel and FSDP beyond their traffic (DTensor dispatch, copies):
  what one tp run and one FSDP run take beyond the prediction, per block and micro-batch;
- communication: ring all-gathers of a few sizes over the ranks of a process group:
  time = latency + bytes x (n - 1) / n / bandwidth, fitted likewise;
- overlap stays at the device type's default (0 on CPU, where gloo's threads share the
  cores with compute).

Results are cached per device name (`save` / `load`, JSON under ~/.cache/mindspeed).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_core.config import from_dict
from mindspeed_core.errors import ConfigError
from mindspeed_core.planning.cost import Calibration, estimate_step_time, step_flops
from mindspeed_core.planning.memory import rank_layers
from mindspeed_core.planning.shape import Job, Layout, ModelShape

logger = logging.getLogger("mindspeed.plan")


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64)[:, None]
    solution = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    return [max(x, 1e-30) for x in solution]


def fit_compute(runs: list[tuple[ModelShape, Layout, Job, float]], calib: Calibration) -> None:
    """Set `flops_per_s` and `block_overhead_s` from measured (shape, layout, job, seconds)
    runs; the communication the cost model predicts for a run (with the bandwidth already
    calibrated, nothing hidden) is taken off its time first."""
    rows, targets = [], []
    overlap, calib.overlap = calib.overlap, 0.0
    for shape, layout, job, seconds in runs:
        predicted = estimate_step_time(shape, layout, job, calib)
        seconds = max(seconds - (predicted.total - predicted.compute), 0.1 * seconds)
        blocks = max(b for b, _, _ in rank_layers(shape, layout))
        passes = 3 if layout.ac == "none" else 4
        accum = max(job.grad_accum(layout), 1)
        rows.append([step_flops(shape, layout, job), blocks * accum * passes / 3])
        targets.append(seconds)
    calib.overlap = overlap
    inverse_flops, calib.block_overhead_s = _least_squares(rows, targets)
    calib.flops_per_s = 1.0 / inverse_flops
    calib.measured["compute"] = [(layout.describe(), s) for _, layout, _, s in runs]


def time_collectives(group=None, sizes=(1 << 18, 1 << 22), repeats: int = 5) -> list[tuple[int, float]]:
    """(bytes per rank, median seconds) of all_gather_into_tensor over `group` (collective:
    every rank of it calls this)."""
    ranks = dist.get_world_size(group)
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else _current_device()
    out = []
    for size in sizes:
        shard = torch.ones(size // 4, device=device)
        full = torch.empty(size // 4 * ranks, device=device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier(group)
            start = time.perf_counter()
            dist.all_gather_into_tensor(full, shard, group=group)
            if device.type != "cpu":
                torch.get_device_module(device.type).synchronize()
            times.append(time.perf_counter() - start)
        out.append((size * ranks, statistics.median(times[1:])))
    return out


def fit_collectives(timings: list[tuple[int, float]], ranks: int, calib: Calibration) -> None:
    """Set `latency_s` and `bandwidth` from all-gather timings of the gathered size."""
    rows = [[1.0, size * (ranks - 1) / ranks] for size, _ in timings]
    calib.latency_s, inverse_bandwidth = _least_squares(rows, [t for _, t in timings])
    calib.bandwidth = 1.0 / inverse_bandwidth
    calib.measured["all_gather"] = timings


def fit_overhead(kind: str, shape: ModelShape, layout: Layout, job: Job, seconds: float,
                 calib: Calibration) -> None:
    """Set `tp_overhead_s` or `fsdp_overhead_s` (kind "tp" / "fsdp") from one measured run:
    what its time exceeds the prediction by, per block and micro-batch."""
    setattr(calib, f"{kind}_overhead_s", 0.0)
    residual = seconds - estimate_step_time(shape, layout, job, calib).total
    blocks = max(b for b, _, _ in rank_layers(shape, layout))
    per_block = residual / (blocks * max(job.grad_accum(layout), 1))
    setattr(calib, f"{kind}_overhead_s", max(per_block, 0.0))
    calib.measured[kind] = (layout.describe(), seconds)


def cache_path(device_name: str) -> Path:
    root = Path(os.environ.get("MINDSPEED_CACHE", Path.home() / ".cache" / "mindspeed"))
    safe = "".join(c if c.isalnum() else "_" for c in device_name)[:80]
    return root / "calibration" / f"{safe}.json"


def save(calib: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calib.to_dict(), indent=1))
    tmp.replace(path)


def load(path: Path) -> Calibration | None:
    """The calibration saved at `path` (None if there is no file).

    Raises:
        ConfigError: the file is no JSON object of Calibration's fields (truncated, a list,
            an unknown key, a value of the wrong type or not finite), naming the file.
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: not a calibration JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a calibration is a JSON object, got {type(data).__name__}")
    return from_dict(Calibration, data, source=str(path))


def load_cached(path: Path) -> Calibration | None:
    """A cached calibration, or None (with one warning) when it cannot be read: the caller
    measures again."""
    try:
        return load(path)
    except ConfigError as err:
        logger.warning("ignoring the cached calibration: %s", err)
        return None


def _current_device() -> torch.device:
    from mindspeed_core import device as dev

    kind = dev.detect_device_type()
    return torch.device(kind, torch.get_device_module(kind).current_device())
