"""The code sandbox: a correct solution passes; an infinite loop is killed at the timeout; a
fork bomb is contained (no process of it survives); a connection to a listener the test
opened on 127.0.0.1 fails; a 2 GB allocation fails; nothing is written outside the work
folder. And the unbiased pass@k estimator against its closed form."""

import math
import os
import socket
import time

import pytest

from mindspeed_eval.sandbox import SandboxLimits, run_program
from mindspeed_eval.tasks.humaneval import pass_at_k

SOLUTION = '''
def add(a: int, b: int) -> int:
    """Sum of a and b."""
    return a + b


def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0


check(add)
'''


def _sandbox_processes() -> int:
    """Processes of the unprivileged sandbox user (the sandbox's only)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == 65534:
                count += 1
        except FileNotFoundError:
            pass
    return count


def test_correct_solution_passes_and_a_wrong_one_fails():
    result = run_program(SOLUTION)
    assert result.passed, result.stderr
    assert not run_program(SOLUTION.replace("a + b", "a - b")).passed
    if os.getuid() == 0:  # as root every strong form is available here
        assert result.confinement["user"] == "nobody"


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", SandboxLimits(timeout_s=2, cpu_s=30))
    assert result.status == "timeout"
    assert time.monotonic() - start < 15


def test_fork_bomb_is_contained():
    before = _sandbox_processes()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    result = run_program(bomb, SandboxLimits(timeout_s=3, max_procs=8))
    assert result.status == "timeout"
    assert result.confinement["processes"] in ("cgroup", "rlimit")
    time.sleep(0.5)
    assert _sandbox_processes() == before


def test_no_network_no_memory_no_writes_outside(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    outside = [tmp_path / "escaped.txt", "/tmp/mindspeed-sandbox-escaped.txt"]
    try:
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = run_program(connect)
        assert result.status == "failed" and "Error" in result.stderr
        assert result.confinement["network"] == "namespace"
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever reached it
    finally:
        listener.close()
    big = run_program("x = bytearray(2 * 1024 ** 3)\n", SandboxLimits(memory_mb=1024))
    assert big.status == "failed" and "MemoryError" in big.stderr
    for path in outside:
        result = run_program(f"open({str(path)!r}, 'w').write('x')\n")
        assert result.status == "failed" and not os.path.exists(path), result.stderr
    inside = run_program("open('here.txt', 'w').write('x')\nprint(open('here.txt').read())\n")
    assert inside.passed and inside.stdout == "x\n"


@pytest.mark.parametrize(
    ("n", "c", "k"), [(10, 3, 1), (10, 3, 5), (5, 0, 2), (5, 5, 3), (20, 7, 10)]
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
