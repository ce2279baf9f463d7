"""A step profiler for training loops: torch.profiler traces of a window of steps.

    profiler = build_profiler(ProfileConfig(steps="3:4"), rank=rank, device=device,
                              run_dir=run_dir, start_step=train.step)
    for ...:
        train_step()
        profiler.step()        # after every optimizer step
    profiler.close()

Each profiled rank writes `<dir>/rank<r>.<ns>.pt.trace.json`: the name torch's
`tensorboard_trace_handler` gives, which torch-tb-profiler's loader matches
(`^(worker)(\\.\\d+)?\\.pt\\.trace\\.json(\\.gz)?$`) and Perfetto / chrome://tracing open.
Next to it go `rank<r>.breakdown.json` and `.txt`: compute vs communication vs idle per
step and the top operators (see `mindspeed_core.profiling.breakdown`). With `memory`,
allocations are recorded in the trace (the tb plugin's Memory view) and, on devices whose
allocator keeps a history (CUDA), `rank<r>.memory_snapshot.pickle` is written for
https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, profile

from mindspeed_core import device as dev
from mindspeed_core.errors import ConfigError
from mindspeed_core.profiling.breakdown import STEP_OFFSET_KEY, write_breakdown

logger = logging.getLogger("mindspeed.profile")


@dataclass(kw_only=True)
class ProfileConfig:
    """The `profile` section of a training command."""

    steps: str | None = None
    """"A:B": profile training steps A to B inclusive (1-based, as in metrics.jsonl);
    "A": that step only; None: no profiling."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that profile themselves; empty: every rank."""
    memory: bool = False
    """Record allocations (tb Memory view) and, where the device allows (CUDA), a memory
    snapshot for pytorch.org/memory_viz."""
    record_shapes: bool = False
    """Record operator input shapes (Operator view grouped by shape)."""
    with_stack: bool = False
    """Record Python call stacks (larger traces; the Module view needs it)."""
    dir: Path | None = None
    """Where traces go; default <run_dir>/tb/profile, so `tensorboard --logdir <run_dir>/tb`
    shows them beside the training curves."""

    def __post_init__(self) -> None:
        if self.steps is not None:
            self.window()  # validate now, not at the first step
        if any(not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ConfigError(f"profile.ranks={self.ranks!r} must be ranks >= 0")

    def window(self) -> tuple[int, int] | None:
        """(first, last) profiled step, or None when profiling is off."""
        if self.steps is None:
            return None
        text = str(self.steps).strip()
        first, _, last = text.partition(":")
        try:
            a, b = int(first), int(last or first)
        except ValueError:
            raise ConfigError(f"profile.steps={self.steps!r} must be 'A:B' or 'A'") from None
        if not 1 <= a <= b:
            raise ConfigError(f"profile.steps={self.steps!r} needs 1 <= A <= B")
        return a, b


class StepProfiler:
    """torch.profiler over steps [first, last] of a run that is at `start_step` now."""

    def __init__(
        self,
        config: ProfileConfig,
        *,
        rank: int,
        device: torch.device,
        run_dir: Path,
        start_step: int = 0,
    ):
        self.first, self.last = config.window()
        self.rank = rank
        self.device = device
        self.memory = config.memory
        self.dir = Path(config.dir or Path(run_dir) / "tb" / "profile")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._step = self._start_step = start_step  # steps finished so far
        self._history = False
        self._prof = profile(
            activities=dev.profiler_activities(device.type),
            schedule=self._action,
            on_trace_ready=self._trace_ready,
            record_shapes=config.record_shapes,
            profile_memory=config.memory,
            with_stack=config.with_stack,
        )
        # torch labels steps ProfilerStep#0, #1, ... from here; the breakdown adds this
        # offset so that its steps are the run's (as in metrics.jsonl, also after a resume).
        self._prof.preset_metadata_json(STEP_OFFSET_KEY, str(start_step + 1))
        self._prof.start()
        self._maybe_record_history()

    def _action(self, index: int) -> ProfilerAction:
        """torch's schedule: what to do during the `index`-th step from the start."""
        k = self._start_step + index + 1
        if k == self.first - 1:
            return ProfilerAction.WARMUP
        if self.first <= k < self.last:
            return ProfilerAction.RECORD
        if k == self.last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _trace_ready(self, prof: profile) -> None:
        # tensorboard_trace_handler's naming, with the rank as the worker name
        trace = self.dir / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        write_breakdown(trace, self.dir / f"rank{self.rank}.breakdown")
        logger.info("rank %d: profile of steps %d:%d in %s", self.rank, self.first,
                    self.last, trace)  # fmt: skip

    def _maybe_record_history(self) -> None:
        if self.memory and not self._history and self._step + 1 >= self.first:
            self._history = dev.record_memory_history(self.device, True)

    def step(self) -> None:
        """Call once after every training step."""
        self._step += 1
        if self._history and self._step == self.last:
            dev.dump_memory_snapshot(self.device, self.dir / f"rank{self.rank}.memory_snapshot.pickle")
            dev.record_memory_history(self.device, False)
            self._history = False
        self._prof.step()
        self._maybe_record_history()

    def close(self) -> None:
        """Stop profiling (a window cut short by the end of training is saved)."""
        if self._history:
            dev.record_memory_history(self.device, False)
            self._history = False
        self._prof.stop()


class _NoProfiler:
    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


def build_profiler(
    config: ProfileConfig | None,
    *,
    rank: int,
    device: torch.device,
    run_dir: Path,
    start_step: int = 0,
) -> StepProfiler | _NoProfiler:
    """The profiler of this rank, or a no-op one when profiling is off, the window is
    already behind `start_step` (a resumed run), or this rank is not profiled."""
    window = None if config is None else config.window()
    if window is None or window[1] <= start_step:
        return _NoProfiler()
    if config.ranks and rank not in config.ranks:
        return _NoProfiler()
    return StepProfiler(config, rank=rank, device=device, run_dir=run_dir, start_step=start_step)
