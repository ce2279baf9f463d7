"""Crash-safe checkpoints: die at every point of a save, run again, lose nothing.

Each case kills a training run at one point of a checkpoint save (before, during and
after each write, rename and `latest` update, and during keep_last deletion), checks
that the newest checkpoint committed before the crash is still there and whole, runs
the same training again and compares every step's loss with a run that never stopped:
they must be bit-identical.

Most points are injected in-process (the manager's `_crash_point` raises an exception
no cleanup handler catches, as a power cut would); the points inside DCP's own writing
and the asynchronous save kill a real process (SIGKILL); `mindspeed pretrain` itself is
killed at three points through MINDSPEED_TEST_CRASH_AT (slow tier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mindspeed_core.checkpoint.manager as manager_module
from mindspeed_core.checkpoint import CheckpointManager, verify_checksums
from mindspeed_core.checkpoint.manager import CRASH_ENV, CRASH_POINTS
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics

driver = import_sibling(__file__, "crash_driver")
STEPS = 8  # saves at 2, 4, 6, 8 (keep_last 2): pruning starts at step 6


class _Crash(BaseException):
    """The process dies here: cleanup handlers (which catch Exception) never see it."""


def _losses(folder: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(folder / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    driver.train(folder, STEPS)
    losses = _losses(folder)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    return losses


def _committed_before(step: int) -> int | None:
    return step - driver.INTERVAL if step > driver.INTERVAL else None


def _check_nothing_lost(folder: Path, crashed_at: int) -> None:
    """The newest checkpoint committed before the crash (or a newer one) is what a rerun
    resumes from, and every step folder left is whole."""
    checkpoints = folder / "checkpoints"
    resume = CheckpointManager({}, checkpoints).latest_step()
    before = _committed_before(crashed_at)
    assert (resume is None) == (before is None) and (resume or 0) >= (before or 0), resume
    for step_dir in checkpoints.glob("step_*"):
        assert verify_checksums(step_dir), step_dir


def _crash_in_process(monkeypatch, folder: Path, point: str, step: int) -> None:
    def crash(name, at):
        if (name, at) == (point, step):
            raise _Crash(f"{name}@{at}")

    with monkeypatch.context() as patch:
        patch.setattr(manager_module, "_crash_point", crash)
        with pytest.raises(_Crash):
            driver.train(folder, STEPS)


# Each case: the crashes of successive attempts, then a clean run. `old_moved_aside`
# needs a step folder that exists but was not committed by `latest`, which a crash
# right after the rename leaves.
CASES = [
    [("before_write", 4)],
    [("before_checksums", 4)],
    [("checksums_written", 4)],
    [("after_checksums", 2)],  # before the first checkpoint is committed
    [("after_checksums", 4)],
    [("after_rename", 4), ("old_moved_aside", 4)],
    [("latest_written", 6)],
    [("after_latest", 6)],
    [("pruning", 6)],
    [("pruning", 8)],
    [("after_prune", 8)],  # the very last save
]


@pytest.mark.parametrize("crashes", CASES, ids=["+".join(f"{p}@{s}" for p, s in c) for c in CASES])
def test_a_crash_at_a_save_point_loses_nothing_and_the_rerun_is_exact(
    crashes, reference, tmp_path, monkeypatch
):
    for point, step in crashes:
        assert point in CRASH_POINTS
        _crash_in_process(monkeypatch, tmp_path, point, step)
        _check_nothing_lost(tmp_path, step)
    driver.train(tmp_path, STEPS)
    assert _losses(tmp_path) == reference  # bit-identical, every step
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["latest", "step_6", "step_8"]  # keep_last=2 and no leftovers


def test_every_save_point_is_covered():
    covered = {point for case in CASES for point, _ in case}
    assert covered == set(CRASH_POINTS)


def _driver(folder: Path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    script = Path(__file__).with_name("crash_driver.py")
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(STEPS), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Killed for real: inside DCP's writing, and in the asynchronous save's commit.
KILLS = [
    ({"CRASH_DRIVER_DCP": "write@4"}, (), 4),  # half a shard file on disk
    ({"CRASH_DRIVER_DCP": "metadata@6"}, (), 6),  # shards whole, .metadata.tmp not renamed
    ({CRASH_ENV: "after_rename@4"}, ("--async",), 4),  # async: committed at the next save
]


@pytest.mark.slow
@pytest.mark.parametrize("env_extra, args, step", KILLS, ids=["dcp-write", "dcp-metadata", "async"])
def test_a_killed_process_loses_nothing_and_the_rerun_is_exact(
    env_extra, args, step, reference, tmp_path
):
    killed = _driver(tmp_path, *args, env_extra=env_extra)
    assert killed.returncode == -9, killed.stderr[-2000:]
    _check_nothing_lost(tmp_path, step)
    rerun = _driver(tmp_path, *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _losses(tmp_path) == reference
