"""`mindspeed pretrain` on two "nodes": two torchrun agents on this machine that meet
through c10d rendezvous on loopback, as agents on two machines do, and write into one run
directory, as nodes sharing a file system do.

- tp=2 across the nodes: the losses of one process, and the checkpoint the two nodes
  wrote resumes in one process with the uninterrupted run's losses.
- dp_shard=2 across the nodes (slow): the losses of one process, every rank's shards saved.
- Elastic restart (slow): a worker SIGKILLed after a checkpoint; torchrun (--max-restarts 1)
  restarts the workers of both nodes, which resume from the last checkpoint and finish with
  the uninterrupted run's losses.
"""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from mindspeed_core.training import read_metrics

pytestmark = pytest.mark.distributed
RTOL = 1e-4  # fp32; different layouts reduce in different orders
STEPS = 20  # conftest's PRETRAIN_ARGS: 20 steps, validation at 10 and 20


def _losses(records, key="loss"):
    """step -> value, from the last record of each step (a restarted run may log one again)."""
    return {r["step"]: r[key] for r in records if key in r}


def _assert_close(got: dict, want: dict, steps):
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=RTOL), (step, got[step], want[step])


def _finish(agents, logs: Path, timeout: int = 600) -> str:
    """Wait for the agents, which must all exit 0; returns their output."""
    try:
        codes = [agent.wait(timeout=timeout) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()  # the agent stops its workers
                agent.wait(timeout=60)
    output = "\n".join((logs / f"agent{i}.log").read_text() for i in range(len(agents)))
    assert codes == [0] * len(agents), output[-4000:]
    return output


def _shard_ranks(step_dir: Path) -> set[int]:
    """The ranks that wrote shard files (DCP names them __<rank>_<n>.distcp)."""
    return {int(p.name.split("_")[2]) for p in step_dir.glob("__*_*.distcp")}


@pytest.fixture(scope="module")
def straight(torchrun, tmp_path_factory) -> dict:
    """One process, 20 steps without interruption: the reference losses by kind and step."""
    records = torchrun(1, tmp_path_factory.mktemp("straight"))
    return {"loss": _losses(records), "valid_loss": _losses(records, "valid_loss")}


def test_tp_across_two_nodes_matches_one_process_and_its_checkpoint_resumes(
    straight, torchrun, torchrun_nodes, tmp_path
):
    run = tmp_path / "run"
    agents = torchrun_nodes(2, run, "--parallel.tp=2", "--train.exit_at_step=10", logs=tmp_path)
    _finish(agents, tmp_path)
    first = read_metrics(run / "metrics.jsonl")
    _assert_close(_losses(first), straight["loss"], range(1, 11))
    _assert_close(_losses(first, "valid_loss"), straight["valid_loss"], [10])
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_10"
    assert _shard_ranks(checkpoints / "step_10") == {0, 1}  # each node's rank saved its half
    # One process continues the two nodes' run (the load verifies every record it reads).
    resumed = torchrun(1, run)
    _assert_close(_losses(resumed), straight["loss"], range(1, STEPS + 1))
    _assert_close(_losses(resumed, "valid_loss"), straight["valid_loss"], [10, 20])


@pytest.mark.slow
def test_data_parallel_across_two_nodes_matches_one_process(straight, torchrun_nodes, tmp_path):
    run = tmp_path / "run"
    _finish(torchrun_nodes(2, run, "--parallel.dp_shard=2", logs=tmp_path), tmp_path)
    records = read_metrics(run / "metrics.jsonl")
    _assert_close(_losses(records), straight["loss"], range(1, STEPS + 1))
    _assert_close(_losses(records, "valid_loss"), straight["valid_loss"], [10, 20])
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    assert _shard_ranks(run / "checkpoints" / f"step_{STEPS}") == {0, 1}


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(
    straight, torchrun_nodes, tmp_path
):
    run = tmp_path / "run"
    agents = torchrun_nodes(
        2, run, "--parallel.dp_shard=2", "--checkpoint.interval=2", logs=tmp_path, max_restarts=1
    )
    try:
        _wait_for(run / "checkpoints" / "latest", agents)
        # Rank 0: it holds the run's lock and writes metrics.jsonl and `latest`.
        os.kill(_worker_pid(agents, rank=0), signal.SIGKILL)
    except BaseException:
        for agent in agents:
            agent.terminate()  # the agent stops its workers
            agent.wait(timeout=60)
        raise
    output = _finish(agents, tmp_path)
    assert "exitcode: -9" in output  # the agent saw its worker die
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", output)]
    assert len(resumed) == 1 and resumed[0] % 2 == 0 and 2 <= resumed[0] < STEPS, resumed
    records = read_metrics(run / "metrics.jsonl")
    _assert_close(_losses(records), straight["loss"], range(1, STEPS + 1))
    _assert_close(_losses(records, "valid_loss"), straight["valid_loss"], [10, 20])
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"


def _wait_for(path: Path, agents, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(agent.poll() is None for agent in agents), "an agent exited before it"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def _worker_pid(agents, rank: int) -> int:
    """The worker process of global `rank`: the child of an agent with RANK=<rank> (Linux)."""
    parents = {agent.pid for agent in agents}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # it exited meanwhile, or is not ours
            continue
        if ppid in parents and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank} under agents {sorted(parents)}")
