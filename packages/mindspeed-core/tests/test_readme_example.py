"""The README's "embed core in your own loop" example, run as a user would: torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.distributed


def _example() -> str:
    text = README.read_text()
    match = re.search(r"<!-- embed-example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README lost its embed example block"
    return match.group(1)


def _torchrun(folder: Path, nproc: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDSPEED_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "embed.py"]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_embed_example_trains_checkpoints_and_resumes_in_another_layout(tmp_path):
    (tmp_path / "embed.py").write_text(_example())
    out = _torchrun(tmp_path, 4)  # tp=2 x dp_shard=2
    losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", out)]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], out
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_40", "step_60"]
    assert (ckpt / "latest").read_text().strip() == "step_60"
    out = _torchrun(tmp_path, 2)  # tp=2 alone: the checkpoint reshards on load
    assert "resumed at step 60" in out and "loss" not in out
