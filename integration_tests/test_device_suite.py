"""benchmarks/device_suite.sh --dry-run: the accelerator suite's every step on the CPU with tiny
shapes, so that the script a GPU session runs cannot rot between sessions."""

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_suite.sh"


def test_the_device_suite_runs_dry_on_cpu(env, tmp_path):
    done = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tests collected" in (tmp_path / "pytest.log").read_text()
    attention = [json.loads(line) for line in (tmp_path / "attention.jsonl").read_text().splitlines()]
    assert {r["impl"] for r in attention if "impl" in r} == {"ours", "sdpa"}
    assert "ours_vs_sdpa_time" in attention[-1]["summary"]["512"]
    train = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[-1])
    assert train["speedup"] > 0 and train["ours"]["tokens_per_s"] > 0
    assert "torchtitan" in train  # measured, or why not
    assert train["ours-fused"]["first_loss"] == train["ours"]["first_loss"]  # the fused loss
    assert train["fused_memory"] > 0
    bad = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
