"""`mindspeed pretrain` (and the tools that read its checkpoints) under faults and attacks.

- Resume: a deleted `latest` and a torn metrics line still resume exactly; a flipped
  byte in a shard is refused naming it; a finished run run again rewrites nothing.
- Hostile checkpoints: a `.metadata` or a non-tensor item that would run a command is
  refused in one line (exit 2) by resume, `--checkpoint.load`, `generate` and `convert`,
  and the command never runs.
- Bad input that used to give tracebacks: one line, exit 2, nothing written.
- Crashes of the real command at three save points (slow), concurrent runs into one
  folder, and a dead rank among two.

The runs are in-process (`mindspeed_core.cli.run`) where they can be, to stay cheap.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindspeed_core.checkpoint.manager import CRASH_ENV
from mindspeed_core.cli import run as cli_run
from mindspeed_core.testing.hostile import plant_hostile_item, plant_hostile_metadata
from mindspeed_core.training import read_metrics

pytestmark = pytest.mark.distributed
STEPS = 5  # checkpoints at 2 and 4, and the final step 5 (not on the interval)
COMMON = [
    f"--train.steps={STEPS}",
    "--train.micro_batch=2",
    "--train.global_batch=2",
    "--data.seq_len=32",
    "--optim.warmup_steps=1",
    "--train.eval_interval=0",
    "--logging.log_interval=1",
    "--logging.progress=false",
    "--logging.tensorboard=false",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last=2",
]
_LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d rank\d+ [A-Z]+\] ")


@pytest.fixture
def in_process(cache, monkeypatch):
    """The environment of an in-process command (the session's demo cache, CPU)."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(cache))
    monkeypatch.setenv("MINDSPEED_DEVICE", "cpu")
    monkeypatch.delenv("MINDSPEED_DEBUG", raising=False)


def _pretrain(capsys, run_dir: Path, *args: str) -> tuple[int, list[str]]:
    """Run `mindspeed pretrain` in this process: (exit status, stderr lines but logs)."""
    capsys.readouterr()
    code = cli_run(["pretrain", *COMMON, f"--logging.run_dir={run_dir}", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.strip() and not _LOG_LINE.match(line)]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory):
    """A straight run of STEPS steps and one stopped after step 4 (checkpoints 2 and 4)."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINDSPEED_CACHE", str(cache))
        patch.setenv("MINDSPEED_DEVICE", "cpu")
        args = [*COMMON, "--logging.progress=false"]
        assert cli_run(["pretrain", *args, f"--logging.run_dir={root / 'straight'}"]) == 0
        stopped = [*args, f"--logging.run_dir={root / 'stopped'}", "--train.exit_at_step=4"]
        assert cli_run(["pretrain", *stopped]) == 0
    assert [s for s, _ in _losses(root / "straight")] == list(range(1, STEPS + 1))
    return root / "straight", root / "stopped"


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / run.name
    shutil.copytree(run, target)
    return target


def _error(code: int, lines: list[str], *fragments: str) -> None:
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- resume --------------------------------------------------------------------------------


def test_a_deleted_latest_and_a_torn_metrics_line_still_resume_exactly(
    runs, in_process, tmp_path, capsys
):
    straight, stopped = runs
    run = _copy(stopped, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # the process died writing this line
    code, lines = _pretrain(capsys, run)
    assert code == 0 and lines == [], lines
    assert _losses(run) == _losses(straight)  # bit-identical, steps 1-5
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["latest", "step_4", "step_5"]


def test_a_flipped_byte_is_refused_naming_the_shard(runs, in_process, tmp_path, capsys):
    run = _copy(runs[1], tmp_path)
    shard = next((run / "checkpoints" / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside a tensor record
    shard.write_bytes(bytes(data))
    _error(*_pretrain(capsys, run), f"checkpoint shard {shard} is corrupt")


def test_a_finished_run_run_again_rewrites_no_checkpoint(runs, in_process, tmp_path, capsys):
    run = _copy(runs[0], tmp_path)
    newest = run / "checkpoints" / "step_5"
    before = {p.name: p.stat().st_mtime_ns for p in newest.iterdir()}
    code, lines = _pretrain(capsys, run)
    assert code == 0 and lines == [], lines
    assert {p.name: p.stat().st_mtime_ns for p in newest.iterdir()} == before
    assert (run / "checkpoints" / "latest").read_text() == "step_5\n"


# -- hostile checkpoints ---------------------------------------------------------------------


def _hostile(runs, tmp_path, kind: str) -> tuple[Path, Path]:
    run = _copy(runs[1], tmp_path)
    marker = tmp_path / "pwned"
    step_dir = run / "checkpoints" / "step_4"
    if kind == "metadata":
        plant_hostile_metadata(step_dir, marker)
    else:
        plant_hostile_item(step_dir, "train.step", marker)
    return run, marker


@pytest.mark.parametrize("kind", ["metadata", "item"])
def test_a_hostile_checkpoint_runs_nothing_on_resume_load_generate_or_convert(
    kind, runs, in_process, tmp_path, capsys
):
    run, marker = _hostile(runs, tmp_path, kind)
    refused = (
        "refused to load global posix.system"
        if kind == "metadata"
        else "train.step is not plain data"
    )
    _error(*_pretrain(capsys, run), refused)
    fresh = tmp_path / "fresh"
    _error(*_pretrain(capsys, fresh, f"--checkpoint.load={run / 'checkpoints'}"), refused)
    assert not (fresh / "metrics.jsonl").exists()
    for argv in (
        ["generate", "--model", str(run / "checkpoints"), "--max-new-tokens", "2", "hello"],
        [
            "convert",
            "--input",
            str(run / "checkpoints"),
            "--output",
            str(tmp_path / "hf"),
            "--to",
            "hf",
        ],
    ):
        capsys.readouterr()
        code = cli_run(argv)
        err = [
            x for x in capsys.readouterr().err.splitlines() if x.strip() and not _LOG_LINE.match(x)
        ]
        if kind == "metadata":  # read by everyone: refused
            _error(code, err, refused)
        else:  # generate and convert read only the model's tensors: the item is never unpickled
            assert code == 0, err
    assert not marker.exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_resumes(
    mode, runs, in_process, tmp_path, capsys
):
    """The save of step 4 runs out of space (sync: as torch's zip writer reports it, a bare
    "unexpected pos" on a full file system; async: ENOSPC from the writer thread): one line,
    exit 2, no temporary left, step 2 intact, and the rerun resumes from it exactly."""
    from mindspeed_core.testing.faults import disk_full_after

    run = tmp_path / "run"
    extra = ["--checkpoint.async_save=true"] if mode == "async" else []
    with disk_full_after(saves=1):
        _error(*_pretrain(capsys, run, *extra), "no space left on device for", ".tmp_step_4")
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_2"]
    assert (folder / "latest").read_text().strip() == "step_2"
    code, lines = _pretrain(capsys, run, *extra)  # the disk has room again
    assert code == 0, lines
    assert [step for step, _ in _losses(run)] == [1, 2, 3, 4, 5]


# -- bad input ------------------------------------------------------------------------------


def test_bad_settings_are_one_line_and_write_nothing(in_process, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cases = [
        (["--optim.lr", "nan"], "optim.lr: expected a finite number, got nan"),
        (["--optim.betas", "[2.0,0.9]"], "optim.betas=[2.0, 0.9] must be two numbers in [0, 1)"),
        ([f"--checkpoint.dir={tmp_path / 'file'}"], f"{tmp_path / 'file'} is a file, not a folder"),
    ]
    for args, fragment in cases:
        _error(*_pretrain(capsys, tmp_path / "run", *args), fragment)
        assert not (tmp_path / "run").exists()
    # (named through the checkpoint folder in it until the loop checks --logging.run_dir)
    _error(*_pretrain(capsys, tmp_path / "file"), f"{tmp_path / 'file'}", ", not a folder")


def test_a_negative_eval_batches_names_the_option(in_process, tmp_path, capsys):
    _error(*_pretrain(capsys, tmp_path / "run", "--train.eval_batches=-1"), "train.eval_batches=-1")


# -- processes ----------------------------------------------------------------------------


def _command(run_dir: Path, *args: str) -> list[str]:
    exe = Path(sys.executable).with_name("mindspeed")
    return [str(exe), "pretrain", *COMMON, f"--logging.run_dir={run_dir}", *args]


def _subprocess_env(cache: Path, **extra: str) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MINDSPEED_DEVICE": "cpu",
        "MINDSPEED_CACHE": str(cache),
        **extra,
    }


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_rename@4", "latest_written@4", "pruning@5"])
def test_the_command_killed_at_a_save_point_resumes_exactly(point, runs, cache, tmp_path):
    run = tmp_path / "run"
    killed = subprocess.run(
        _command(run),
        env=_subprocess_env(cache, MINDSPEED_TEST_CRASH_AT=point),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    rerun = subprocess.run(
        _command(run), env=_subprocess_env(cache), capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _losses(run) == _losses(runs[0])
    assert "cuda" not in (killed.stderr + rerun.stderr).lower()  # no CUDA notice on CPU


def test_a_second_run_into_the_same_folder_refuses_and_a_killed_runs_lock_is_taken_over(
    cache, tmp_path
):
    run = tmp_path / "run"
    env = _subprocess_env(cache)
    first = subprocess.Popen(
        _command(run, "--train.steps=100000", "--optim.warmup_steps=1"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)  # the first run is training
        second = subprocess.run(_command(run), env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and f"is in use by pid {first.pid}" in second.stderr, (
            second.stderr[-2000:]
        )
        # it refused without waiting for the holder (no timing bound: CI machines are loaded)
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
    third = subprocess.run(_command(run), env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]


@pytest.mark.slow
def test_a_dead_rank_is_one_line_from_the_survivor(cache, tmp_path):
    """Rank 1 is SIGKILLed in its first save; rank 0 says which rank died, in one line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = _subprocess_env(
        cache, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
    )
    procs = []
    for rank in (0, 1):
        extra = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        if rank == 1:
            extra[CRASH_ENV] = "before_checksums@2"
        procs.append(
            subprocess.Popen(
                _command(tmp_path / "run", "--train.global_batch=4"),
                env={**base, **extra},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    err = procs[0].communicate(timeout=300)[1]
    assert procs[1].wait(timeout=300) == -signal.SIGKILL
    lines = [x for x in err.splitlines() if x.strip() and not _LOG_LINE.match(x)]
    assert procs[0].returncode == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: rank 1 (pid {procs[1].pid} on ") and "has died" in lines[0]
