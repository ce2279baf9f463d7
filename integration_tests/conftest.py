"""What the end-to-end tests share: one demo-corpus cache per session, the environment
every command runs in, `mindspeed pretrain` under torchrun (one node, or one agent per
"node" on this machine), the `mindspeed` command, and the check that a checkpoint
converts to a transformers model with our logits.

Each fixture that runs something returns a function, so a test calls it with its own
arguments.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_core.training import read_metrics

MINDSPEED = Path(sys.executable).with_name("mindspeed")
PRETRAIN_ARGS = [
    "--train.steps=20",
    "--train.micro_batch=2",
    "--train.global_batch=8",
    "--data.seq_len=64",
    "--optim.warmup_steps=2",
    "--train.eval_interval=10",
    "--train.eval_batches=2",
    "--logging.log_interval=1",
    "--logging.progress=false",
    "--logging.tensorboard=false",
    "--checkpoint.interval=0",
]
"""A short CPU run of the demo model; a test's own arguments come after and win."""


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """$MINDSPEED_CACHE: the demo corpus is built there once per session."""
    return tmp_path_factory.mktemp("mindspeed-cache")


@pytest.fixture(scope="session")
def env(cache) -> dict:
    """The environment of every command: CPU, one thread per process, the session cache."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MINDSPEED_DEVICE": "cpu",
        "MINDSPEED_CACHE": str(cache),
    }


@pytest.fixture(scope="session")
def torchrun(env):
    """`torchrun(nproc, run_dir, *args, timeout=600)`: `mindspeed pretrain` on `nproc` CPU
    processes with PRETRAIN_ARGS and `args`; returns the run's metrics.jsonl records."""

    def run(nproc: int, run_dir: Path, *args: str, timeout: int = 600) -> list[dict]:
        launch = ["--standalone", f"--nproc-per-node={nproc}"]
        cmd = _pretrain_command(launch, run_dir, args)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-4000:]
        return read_metrics(run_dir / "metrics.jsonl")

    return run


@pytest.fixture(scope="session")
def torchrun_nodes(env):
    """`torchrun_nodes(num_nodes, run_dir, *args, logs, max_restarts=0)`: start `mindspeed
    pretrain` as `num_nodes` torchrun agents of one process each, as separate nodes would
    (c10d rendezvous on a free loopback port, a new job id); returns the agents' Popen
    objects, agent i writing its output to `logs`/agent<i>.log. All write into `run_dir`,
    as nodes sharing one file system do."""

    def start(num_nodes: int, run_dir: Path, *args: str, logs: Path, max_restarts: int = 0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [f"--nnodes={num_nodes}", "--nproc-per-node=1", "--rdzv-backend=c10d"]
        launch += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test-{os.getpid()}-{port}"]
        launch += ["--local-addr=127.0.0.1", f"--max-restarts={max_restarts}"]
        cmd = _pretrain_command(launch, run_dir, args)
        # A restarted worker group must not meet in the store of the one before: torch >= 2.5
        # keeps the agent's store across restarts, where the dead workers' addresses are
        # still found (gloo "Connection refused"; pytorch/pytorch#135712). The README says so.
        agent_env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts else env
        logs.mkdir(parents=True, exist_ok=True)
        agents = []
        for node in range(num_nodes):
            with open(logs / f"agent{node}.log", "w") as out:
                agents.append(
                    subprocess.Popen(cmd, env=agent_env, stdout=out, stderr=subprocess.STDOUT)
                )
        return agents

    return start


def _pretrain_command(launch: list[str], run_dir: Path, args) -> list[str]:
    """torchrun with the `launch` flags, running `mindspeed pretrain` with PRETRAIN_ARGS."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "mindspeed_llm.pretrain"]
    return cmd + [*PRETRAIN_ARGS, f"--logging.run_dir={run_dir}", *args]


@pytest.fixture(scope="session")
def mindspeed(env):
    """`mindspeed(*args, timeout=300)`: the installed command, as a CompletedProcess."""

    def run(*args, timeout: int = 300) -> subprocess.CompletedProcess:
        cmd = [str(MINDSPEED), *map(str, args)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def pretrain_cli(mindspeed):
    """`pretrain_cli(run_dir, *args)`: `mindspeed pretrain` in one process with PRETRAIN_ARGS
    and `args`, as a CompletedProcess (for the checks of bad input)."""

    def run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
        return mindspeed("pretrain", *PRETRAIN_ARGS, f"--logging.run_dir={run_dir}", *args)

    return run


@pytest.fixture(scope="session")
def converts_to_transformers():
    """`converts_to_transformers(checkpoint, out)`: `mindspeed convert --to hf` of a
    trainer checkpoint gives a folder transformers loads with our logits (fp32, 1e-5);
    returns (the transformers model, our config)."""

    def check(checkpoint: Path, out: Path):
        import torch
        import transformers

        from mindspeed_llm.loading import load_model
        from mindspeed_tools.convert import mindspeed_to_hf

        mindspeed_to_hf(checkpoint, out)
        ours, config = load_model(checkpoint)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(theirs.eval()(ids).logits, ours(ids), atol=1e-5, rtol=0)
        return theirs, config

    return check
