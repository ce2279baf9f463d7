"""Process-tree helpers for tests that kill a parent and look for what it left behind
(Linux: they read /proc)."""

from __future__ import annotations

import time

from mindspeed_core.lifeline import _stat, descendants

__all__ = ["alive", "descendants", "gone_within"]


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    info = _stat(pid)
    return None if info is None else info[:2]


def alive(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, state letter) of the processes in `pids` that still run (zombies count as gone)."""
    return [(p, info[1]) for p in pids if (info := _ppid_and_state(p)) and info[1] != "Z"]


def gone_within(pids: list[int], seconds: float) -> float | None:
    """Seconds until every pid in `pids` is gone, or None if one outlives `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not alive(pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return None
