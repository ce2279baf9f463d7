import json
import os
import subprocess
import sys
from pathlib import Path

import mindspeed_core
from mindspeed_core.cli import Command, guarded, run
from mindspeed_core.errors import ConfigError

MINDSPEED = Path(sys.executable).with_name("mindspeed")


def cli(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_DEBUG"}
    env.update(env_extra or {})
    return subprocess.run(
        [str(MINDSPEED), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"mindspeed {mindspeed_core.__version__}"


def test_runs_as_a_module():
    """`python -m mindspeed_core.cli COMMAND` (what torchrun launches) is the `mindspeed` command."""
    proc = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "--version"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == f"mindspeed {mindspeed_core.__version__}"
    proc = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", "no-such-command"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "unknown command 'no-such-command'" in proc.stderr


def test_help_lists_installed_commands(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "env " in out and "usage: mindspeed" in out


def test_env_reports_device_packages_and_compiler():
    proc = cli("env", "--json", env_extra={"MINDSPEED_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    import torch

    assert info["torch"] == torch.__version__
    assert (info["device"], info["backend"], info["device_count"]) == ("cpu", "gloo", 1)
    assert info["packages"]["mindspeed-core"] == mindspeed_core.__version__
    assert "cxx_compiler" in info and info["device_override"] == "cpu"
    text = cli("env", env_extra={"MINDSPEED_DEVICE": "cpu"}).stdout
    assert (
        "mindspeed-core " + mindspeed_core.__version__ in text and "backend            gloo" in text
    )


def test_unknown_subcommand_is_one_line_listing_installed_ones():
    proc = cli("trian")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown command 'trian'; installed commands: "
        + ", ".join(sorted(ep for ep in _installed()))
    ]


def _installed():
    from mindspeed_core.cli import discover_commands

    return discover_commands()


def test_user_error_is_one_line_exit_2_and_debug_shows_traceback():
    proc = cli("env", env_extra={"MINDSPEED_DEVICE": "tpu"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: MINDSPEED_DEVICE='tpu' is not a device type; choose one of auto, cpu, cuda, npu"
    ]
    debug = cli("--debug", "env", env_extra={"MINDSPEED_DEVICE": "tpu"})
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    debug_env = cli("env", env_extra={"MINDSPEED_DEVICE": "tpu", "MINDSPEED_DEBUG": "1"})
    assert "Traceback" in debug_env.stderr


def test_guarded_folds_multiline_messages(capsys):
    def bad(_argv):
        raise ConfigError("first line\nsecond line")

    assert guarded(Command(help="x", run=bad).run, []) == 2
    assert capsys.readouterr().err == "error: first line second line\n"


_DIES = """
import os, signal, sys
import torch, torch.distributed as dist
from mindspeed_core.cli import guarded
from mindspeed_core.distributed import init_distributed

def main(argv):
    init_distributed(device_type="cpu")
    t = torch.ones(8)
    for step in range(10000):
        if dist.get_rank() == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    return 0

sys.exit(guarded(main, []))
"""


def test_a_dead_rank_is_named_in_one_line_by_the_survivor(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(_DIES)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    survivor, dead = procs[0].communicate(timeout=120)[1], procs[1].wait(timeout=120)
    assert dead == -9 and procs[0].returncode == 2
    lines = [line for line in survivor.splitlines() if line.strip()]
    assert len(lines) == 1, survivor
    assert lines[0].startswith(f"error: rank 1 (pid {procs[1].pid} on ")
    assert "has died; rank 0 stopped in a collective" in lines[0]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
