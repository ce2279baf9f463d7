"""mindspeed_core.lifeline: pool workers die with a parent killed by SIGKILL or SIGTERM, under
each start method, also while they are still importing their worker module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindspeed_core.testing.processes import alive, descendants, gone_within

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

HERE = Path(__file__).parent


def start_parent(method: str, mode: str, workers: int = 2) -> tuple[subprocess.Popen, list[int]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    parent = subprocess.Popen(
        [sys.executable, str(HERE / "lifeline_parent.py"), method, mode],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert parent.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    # the workers (and, for forkserver, the server; for spawn, the resource tracker)
    while len(descendants(parent.pid)) < workers and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # let them get into their import or their work
    return parent, descendants(parent.pid)


@pytest.mark.parametrize(
    ("method", "mode", "how"),
    [
        ("spawn", "slow-import", signal.SIGKILL),  # the preprocess workers' case (Q3)
        ("forkserver", "busy", signal.SIGKILL),
        ("fork", "busy", signal.SIGTERM),
    ],
)
def test_workers_die_with_their_parent(method, mode, how):
    parent, children = start_parent(method, mode)
    try:
        assert len(children) >= 2, children
        os.kill(parent.pid, how)
        parent.wait(timeout=10)
        took = gone_within(children, 5.0)
        assert took is not None, alive(children)
    finally:
        for pid, _ in alive(children):
            os.kill(pid, signal.SIGKILL)
        parent.kill()


def test_a_child_of_a_dead_parent_exits_at_once():
    # Armed after the parent died (it was killed before the child got that far): exits 1.
    code = (
        "import os, sys; from mindspeed_core.lifeline import die_with_parent; "
        "die_with_parent(int(sys.argv[1])); print('survived')"
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    result = subprocess.run(
        [sys.executable, "-c", code, str(dead.pid)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "survived" not in result.stdout
    alive_parent = subprocess.run(
        [sys.executable, "-c", code.replace("int(sys.argv[1])", "os.getppid()")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert alive_parent.returncode == 0 and alive_parent.stdout.strip() == "survived"


REAPED_PARENT = """
import subprocess, sys, time
from mindspeed_core.lifeline import Reaper
reaper = Reaper()
# helpers that arm nothing, as a local Ray cluster's: a child, and a grandchild in its own session
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                  "[sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
                  "time.sleep(600)"])
if sys.argv[1] == "close":
    reaper.close()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_reaper_kills_what_a_dead_parent_left_behind(how):
    parent = subprocess.Popen([sys.executable, "-c", REAPED_PARENT, "open"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(descendants(parent.pid)) < 3 and time.monotonic() < deadline:  # watcher, child, grandchild
            time.sleep(0.05)
        time.sleep(0.5)  # the watcher's first look
        helpers = descendants(parent.pid)
        assert len(helpers) == 3, helpers
        os.kill(parent.pid, how)
        parent.wait(timeout=10)
        assert gone_within(helpers, 5.0) is not None, alive(helpers)
    finally:
        parent.kill()


def test_a_closed_reaper_kills_nothing():
    parent = subprocess.Popen([sys.executable, "-c", REAPED_PARENT, "close"], stdout=subprocess.PIPE, text=True)
    helpers = []
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        helpers = descendants(parent.pid)
        assert len(helpers) == 2, helpers  # the watcher is gone
        parent.kill()
        parent.wait(timeout=10)
        time.sleep(1.0)
        assert len(alive(helpers)) == 2  # orphans (what the caller chose), not killed
    finally:
        for pid, _ in alive(helpers):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
