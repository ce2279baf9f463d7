"""Process-tree helpers for tests that kill a parent and look for what it left behind
(Linux: they read /proc)."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["alive", "descendants", "gone_within"]


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def descendants(pid: int) -> list[int]:
    """Living processes below `pid` (children, grandchildren, ...). Take the snapshot before
    killing `pid`: its orphans are re-parented and no longer found under it."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _ppid_and_state(int(entry))) and info[1] != "Z":
            parent_of[int(entry)] = info[0]
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier}
        found += sorted(frontier)
    return found


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
