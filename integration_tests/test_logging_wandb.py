"""`logging.wandb`: a run logs to Weights & Biases (offline) the scalars of metrics.jsonl at the
same steps, read back with wandb's own record reader; a resumed run continues the same W&B
run; without the package the run is refused in one line before anything is written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")


def _wandb_history(run_dir: Path) -> dict[int, dict]:
    """{step: scalars} of every offline W&B run file under `run_dir/wandb`, read by wandb's own
    reader (`wandb leet inspect --json`: one record of the .wandb log per line)."""
    cli = Path(sys.executable).parent / "wandb"
    out: dict[int, dict] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        done = subprocess.run([str(cli), "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        for line in done.stdout.splitlines():
            record = json.loads(line)
            if record.get("type") == "history":
                items = record["history"]["item"]
                out[int(record["history"]["step"]["num"])] = {
                    k: v for k, v in items.items() if not k.startswith("_")
                }
    return out


@pytest.mark.slow
def test_wandb_gets_the_metrics_of_the_run_and_a_resume_continues_it(pretrain_cli, tmp_path):
    run = tmp_path / "run"
    done = pretrain_cli(run, "--logging.wandb=true", "--logging.wandb_project=tests",
                        "--train.exit_at_step=10")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first_id = (run / "wandb-run-id").read_text().strip()
    done = pretrain_cli(run, "--logging.wandb=true", "--logging.wandb_project=tests")  # resumes
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "wandb-run-id").read_text().strip() == first_id  # the same W&B run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    history = _wandb_history(run)
    assert sorted(history) == [r["step"] for r in records] and len(records) >= 4
    for r in records:
        scalars = {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        assert history[r["step"]] == pytest.approx(scalars, rel=1e-12), r["step"]


def test_without_the_package_the_run_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from mindspeed_core.cli import run as cli

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    run = tmp_path / "run"
    assert cli(["pretrain", f"--logging.run_dir={run}", "--logging.wandb=true", "--train.steps=2",
                "--optim.warmup_steps=1"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'mindspeed-core[wandb]'" in err
    assert not run.exists()
