"""RunLock: one run per folder; a second refuses at once; a killed holder does not block."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import run_distributed
from mindspeed_core.training import RunLock, acquire_run_lock, release_all

_HOLD = """
import sys, time
from mindspeed_core.training import RunLock
lock = RunLock(sys.argv[1]).acquire()  # held while referenced
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _both_ranks_refuse(folder):
    try:
        acquire_run_lock((folder, "--logging.run_dir"))
    except ConfigError as err:
        return str(err)
    return None


def test_a_second_run_refuses_and_a_killed_holder_is_taken_over(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        start = time.monotonic()
        with pytest.raises(
            ConfigError, match=rf"run directory .*run is in use by pid {holder.pid} on "
        ):
            RunLock(tmp_path / "run").acquire()
        assert time.monotonic() - start < 5
        messages = run_distributed(_both_ranks_refuse, 2, str(tmp_path / "run"), timeout=120)
        assert all(
            m and f"--logging.run_dir {tmp_path / 'run'} is in use by pid {holder.pid}" in m
            for m in messages
        )
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with RunLock(tmp_path / "run") as lock:  # the stale lock file of a SIGKILLed run
        assert lock.held
        assert f'"pid": {os.getpid()}' in (tmp_path / "run" / ".lock").read_text()
    locks = acquire_run_lock((tmp_path / "run", "a"), (tmp_path / "run", "b"))  # same folder once
    assert len(locks) == 1
    release_all(locks)


def test_a_run_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--checkpoint.dir .*file is a file, not a folder"):
        RunLock(tmp_path / "file", "--checkpoint.dir")
