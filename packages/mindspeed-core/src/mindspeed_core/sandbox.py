"""Run untrusted generated code (HumanEval-style programs) in a confined subprocess.

`run_program(code)` writes the program into a fresh temporary folder and runs it in a new
Python process (`python -I -B`, an empty environment, its own session so the whole
process group can be killed) through a small launcher, `_sandbox_child.py`, which confines
itself before running the program. Each confinement has a stronger and a weaker form; the
weaker one is used only when the stronger is not permitted, and `ExecResult.confinement`
says which were in force:

=========== ============================================== =================================
what        stronger (root / CAP_SYS_ADMIN, as here)       weaker (otherwise)
=========== ============================================== =================================
time        wall clock (the parent kills the group) and    same
            RLIMIT_CPU
memory      RLIMIT_AS                                      same
processes   a pids cgroup (v1 or v2) when one is           RLIMIT_NPROC, which binds only
            writable, and RLIMIT_NPROC after dropping to   a non-root user: as root with no
            the unprivileged user `nobody`                 writable cgroup, none
network     a new, empty network namespace (no interface   `socket.socket` replaced by one
            is up: every connection fails)                 that raises (Python-level only)
files       a new mount namespace where every mount is     the work folder only is given to
            read-only except the work folder               `nobody`; world-writable places
                                                           stay writable
leftovers   a new pid namespace: when the program's first  the process group is killed
            process ends, the kernel kills and reaps the   (orphans may stay zombies under
            rest                                           an init that does not reap)
=========== ============================================== =================================

The parent always kills the process group (and the cgroup's members) when the program ends
or times out, and removes the temporary folder.

It lives in core (standard library only) because two packages that may not import each other
run generated code: mindspeed-eval's HumanEval (`mindspeed_eval.sandbox` re-exports this) and
mindspeed-align's code-execution reward.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ExecResult", "SandboxLimits", "run_program"]

CHILD = Path(__file__).with_name("_sandbox_child.py")
_CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


@dataclass(kw_only=True)
class SandboxLimits:
    """What one program may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space in MiB (RLIMIT_AS)."""
    max_procs: int = 16
    """Processes (pids cgroup and, once unprivileged, RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""


@dataclass
class ExecResult:
    """How a program ended."""

    status: str
    """"passed" (exit 0), "failed" (non-zero exit or killed by a limit) or "timeout"."""
    returncode: int | None
    stdout: str
    stderr: str
    confinement: dict[str, str] = field(default_factory=dict)
    """Which form of each confinement was in force (see the module docstring)."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(code: str, limits: SandboxLimits | None = None) -> ExecResult:
    """Run Python source `code` confined; never raises for what the program does."""
    limits = limits or SandboxLimits()
    work = Path(tempfile.mkdtemp(prefix="mindspeed-sandbox-"))
    cgroup = _make_pids_cgroup(limits.max_procs)
    try:
        (work / "program.py").write_text(code, encoding="utf-8")
        report = work / "confinement.json"
        config = {
            "work": str(work),
            "report": str(report),
            "cgroup": str(cgroup) if cgroup else None,
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_mb << 20,
            "max_procs": limits.max_procs,
            "max_file_bytes": limits.max_file_mb << 20,
        }
        result = _run_child(work, config, limits.timeout_s)
        with contextlib.suppress(OSError, ValueError):
            result.confinement = json.loads(report.read_text())
        if cgroup is None:
            result.confinement["processes"] = result.confinement.get("processes", "none")
        return result
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        shutil.rmtree(work, ignore_errors=True)


def _run_child(work: Path, config: dict, timeout_s: float) -> ExecResult:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work)}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", "-S", str(CHILD), json.dumps(config)],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    status = None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        status = "timeout"
        proc.terminate()  # the launcher kills the program's pid namespace and reaps it
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
    _kill_group(proc.pid)  # leftovers of a program that forked
    code = proc.returncode
    if status is None:
        cpu_killed = code in (-signal.SIGXCPU, -signal.SIGKILL)
        status = "passed" if code == 0 else ("timeout" if cpu_killed else "failed")
    text = {"errors": "replace"}
    return ExecResult(status, code, out.decode(**text), err.decode(**text))


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# -- pids cgroup -------------------------------------------------------------------------


def _make_pids_cgroup(max_procs: int) -> Path | None:
    """A fresh pids cgroup limited to `max_procs`, or None where none is writable."""
    for root in _CGROUP_ROOTS:
        limit = "pids.max"
        if not (root / "cgroup.procs").exists():
            continue
        if root == Path("/sys/fs/cgroup") and not (root / "cgroup.controllers").exists():
            continue  # not a cgroup v2 root
        try:
            group = Path(tempfile.mkdtemp(prefix="mindspeed-sandbox-", dir=root))
        except OSError:
            continue
        try:
            (group / limit).write_text(str(max_procs))
            return group
        except OSError:
            _remove_cgroup(group)
    return None


def _remove_cgroup(group: Path) -> None:
    """Kill what is still in the cgroup, then remove it."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        group.rmdir()
