"""Helper processes that die with the process that started them, even when it is SIGKILLed.

A SIGKILLed parent runs no cleanup, so its workers must notice by themselves. Two mechanisms,
armed by `die_with_parent` as the first thing a child does:
- Linux: the kernel's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), immediate;
- everywhere: a daemon thread that polls the parent's pid every `POLL_S` seconds (a process
  whose parent died is re-parented, so `os.getppid()` changes).

Why arming *first* matters: a `spawn`ed multiprocessing child unpickles its initializer by
importing the initializer's module, and a worker module that pulls in torch takes 5-15 s to
import on a 2-core machine. A worker that armed the signal only after those imports outlived a
parent killed during them (the preprocess workers on a loaded Intel machine). So pools name
their real initializer as a string, and `pool_initializer` (in this module, which imports only
the standard library) arms the lifeline before importing it:

    ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                        initializer=pool_initializer,
                        initargs=(os.getpid(), "pkg.worker:init", arg1, arg2))

Works for the fork, forkserver and spawn start methods: the parent is named by pid, not taken
from `os.getppid()` (a forkserver child's parent is the fork server, which itself exits when
the parent does).

One import comes before any initializer: a spawned child first re-imports its parent's main
module as `__mp_main__` (unless that is a package's `__main__`). An entry module that starts
pools and imports torch at the top (`python -m mindspeed_align.rl.cli`) therefore begins with
`arm_if_spawned_helper(__name__)`: `spawn_context()` leaves the parent's pid in the
environment, and the child arms from it before its heavy imports.

Processes we do not start ourselves cannot arm anything: a local Ray cluster's raylet and GCS
follow the driver (Ray's own fate sharing), but its dashboard and runtime-env agents wait for
the dead GCS for about a minute. `Reaper` covers them: a small watcher outside the trainer's
session that, once the trainer is gone, SIGKILLs every process that was below it (Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ENV_VAR", "POLL_S", "Reaper", "arm_if_spawned_helper", "descendants",
           "die_with_parent", "parent_alive", "pool_initializer", "spawn_context"]

ENV_VAR = "MINDSPEED_LIFELINE_PARENT"
"""Set by `spawn_context` to the pid its children must die with."""

POLL_S = 0.2
"""How often the watch thread looks at the parent: a dead parent is noticed within this."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_alive(parent_pid: int, direct_parent: int | None = None) -> bool:
    """Whether `parent_pid` still runs. `direct_parent`: this process's parent when the watch
    began (`parent_pid` itself, or a fork server between the two); a change means one died."""
    direct_parent = parent_pid if direct_parent is None else direct_parent
    if os.getppid() != direct_parent:  # re-parented: our parent died (zombies included)
        return False
    if direct_parent == parent_pid:
        return True
    try:  # a forkserver child: the server is our parent, `parent_pid` is further up
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid now belongs to someone else
        return False
    return True


def die_with_parent(parent_pid: int, *, poll_s: float = POLL_S) -> None:
    """Exit (status 1, no cleanup: in-flight work stops) as soon as `parent_pid` dies.

    Call it first in a child; safe to call more than once. A parent that already died makes
    this call exit at once.
    """
    direct_parent = os.getppid()
    if direct_parent == parent_pid and sys.platform.startswith("linux"):
        # Only for a direct child: the signal follows the thread that forked us, which for a
        # forkserver child is the server, not `parent_pid`.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if not parent_alive(parent_pid, direct_parent):
        os._exit(1)
    if not any(t.name == _THREAD_NAME for t in threading.enumerate()):
        threading.Thread(
            target=_watch,
            args=(parent_pid, direct_parent, poll_s),
            name=_THREAD_NAME,
            daemon=True,
        ).start()


_THREAD_NAME = "mindspeed-lifeline"


def _watch(parent_pid: int, direct_parent: int, poll_s: float) -> None:
    while parent_alive(parent_pid, direct_parent):
        time.sleep(poll_s)
    os._exit(1)


def spawn_context():
    """multiprocessing's spawn context, with this process's pid left in the environment
    (which spawned children inherit) for `arm_if_spawned_helper`."""
    import multiprocessing

    os.environ[ENV_VAR] = str(os.getpid())
    return multiprocessing.get_context("spawn")


def arm_if_spawned_helper(module_name: str) -> None:
    """Call first in an entry module that may start pools: in a spawned child re-importing
    it (`module_name == "__mp_main__"`), tie the child to its parent before anything else."""
    parent = os.environ.get(ENV_VAR)
    if module_name == "__mp_main__" and parent and parent.isdigit():
        die_with_parent(int(parent))


def pool_initializer(parent_pid: int, target: str | None = None, *args: Any) -> None:
    """A process pool's initializer: arm `die_with_parent(parent_pid)`, then import and call
    `target` ("module:function") with `args`. Pickles as a reference to this light module, so
    nothing heavy is imported before the lifeline is armed."""
    die_with_parent(parent_pid)
    if target is not None:
        resolve(target)(*args)


def resolve(target: str) -> Callable[..., Any]:
    """The function named by "module:function"."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time in clock ticks) of `pid` from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> list[int]:
    """Living processes below `pid` (children, grandchildren, ...), Linux only (empty
    elsewhere). Take the snapshot before `pid` dies: its orphans are re-parented."""
    if not Path("/proc/self/stat").exists():
        return []
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) and info[1] != "Z":
            parent_of[int(entry)] = info[0]
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier}
        found += sorted(frontier)
    return found


class Reaper:
    """While open, every process below this one dies within about `POLL_S` of it, even when
    this process is SIGKILLed: a watcher (`python -m mindspeed_core.lifeline`, in its own
    session, standard library only) keeps a list of our descendants and kills the ones still
    running once we are gone. `close()` stops the watcher and kills nothing. Linux only (a
    no-op elsewhere). For helpers started by a library we do not control (a local Ray cluster);
    our own helpers arm `die_with_parent` instead."""

    def __init__(self) -> None:
        import subprocess

        self.process = None
        if Path("/proc/self/stat").exists():
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mindspeed_core.lifeline", str(os.getpid())],
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reap(parent_pid: int, poll_s: float = POLL_S) -> None:
    """The watcher of `Reaper`: follow `parent_pid`'s descendants, then kill the survivors."""
    me, known = os.getpid(), {}
    parent = _stat(parent_pid)
    while parent is not None and (now := _stat(parent_pid)) and now[2] == parent[2] and now[1] != "Z":
        for pid in descendants(parent_pid):
            if pid != me and pid not in known and (info := _stat(pid)):
                known[pid] = info[2]
        time.sleep(poll_s)
    for pid, started in known.items():  # the same process: a reused pid has another start time
        if (info := _stat(pid)) and info[2] == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
