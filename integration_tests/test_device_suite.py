"""benchmarks/device_suite.sh --dry-run: the accelerator suite's every step on the CPU with tiny
shapes (attention, eager and compiled training, decoding, host time per step, the GPU tests
collected), so that the script a GPU session runs cannot rot between sessions."""

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_suite.sh"


def test_the_device_suite_runs_dry_on_cpu(env, tmp_path):
    slow_cpu = {**env, "SUITE_TIME_SCALE": "10"}  # the steps' bounds are set for a GPU host
    done = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=slow_cpu, capture_output=True,
        text=True, timeout=1200,
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
    compiled = json.loads((tmp_path / "train_compiled.jsonl").read_text().splitlines()[-1])
    assert compiled["compile"] and compiled["ours"]["tokens_per_s"] > 0
    decode = [json.loads(line) for line in (tmp_path / "generate.jsonl").read_text().splitlines()]
    assert decode and all("ours" in str(row) for row in decode)
    host = json.loads((tmp_path / "host_overhead.jsonl").read_text().splitlines()[-1])
    assert host["host_ratio"] > 0 and host["ours"]["ops"] > 0 and host["transformers"]["ops"] > 0
    bad = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
