import os
import time

import pytest
import torch
import torch.distributed as dist

from mindspeed_core.testing import RankFailure, RankTimeout, run_distributed

pytestmark = pytest.mark.distributed


def _allreduce_rank(scale):
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": x.item() * scale,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_distributed(_allreduce_rank, world_size, 10.0)
    expected_sum = 10.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["world"] == world_size and r["sum"] == expected_sum
        assert r["omp"] == "1" and r["threads"] == 1 and r["backend"] == "gloo"


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    dist.barrier()  # the healthy ranks would wait here forever
    return True


@pytest.mark.parametrize(("world_size", "bad_rank"), [(2, 1), (4, 2)])
def test_a_failing_rank_reaches_the_caller_with_its_traceback(world_size, bad_rank):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(_raise_on_rank, world_size, bad_rank, timeout=60)
    assert info.value.rank == bad_rank
    assert "ValueError: boom from rank" in str(info.value)
    assert "_raise_on_rank" in info.value.remote_traceback  # the frame that raised
    assert time.monotonic() - start < 45  # the others were killed, not waited for


def _hang_and_record_pid(folder, hang_rank):
    with open(os.path.join(folder, f"{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == hang_rank:
        time.sleep(600)
    return dist.get_rank()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_hanging_rank_times_out_and_every_rank_is_killed(tmp_path, world_size):
    start = time.monotonic()
    with pytest.raises(
        RankTimeout, match=rf"ranks \[{world_size - 1}\] of {world_size} did not finish"
    ):
        # Long enough for every rank to start even on a loaded 2-core machine.
        run_distributed(_hang_and_record_pid, world_size, str(tmp_path), world_size - 1, timeout=20)
    assert time.monotonic() - start < 45
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == world_size
    assert not any(_alive(pid) for pid in pids)


def _exit_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    return 0


def test_a_rank_that_dies_without_a_result_is_reported():
    with pytest.raises(RankFailure, match="rank 1 failed:\nprocess exited with code 3"):
        run_distributed(_exit_hard, 2, timeout=60)


def _start_a_helper() -> int:
    """A rank that leaves a process of its own behind (as a library's Manager does)."""
    import subprocess

    return subprocess.Popen(["sleep", "120"]).pid


def test_what_a_rank_started_dies_with_it():
    pids = run_distributed(_start_a_helper, 2, timeout=60)
    deadline = time.monotonic() + 10
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # a zombie waits for init: it is gone
                    if f.read().split(")")[1].split()[0] == "Z":
                        alive.discard(pid)
            except (ProcessLookupError, FileNotFoundError):
                alive.discard(pid)
        time.sleep(0.1)
    assert not alive, f"helper processes {sorted(alive)} outlived their ranks"
