"""`mindspeed convert` end to end: an HF model trained under tp=2 by `mindspeed pretrain
--model.hf_path` converts back to a folder transformers loads, and the real command turns
bad input into one line and exit code 2, leaving nothing behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics

ROOT = Path(__file__).resolve().parents[1]
models_hf = import_sibling(str(ROOT / "packages/mindspeed-llm/tests/conftest.py"), "models_hf")
pytestmark = pytest.mark.distributed
MINDSPEED = Path(sys.executable).with_name("mindspeed")


def _env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MINDSPEED_DEVICE": "cpu",
        "MINDSPEED_CACHE": str(tmp_path / "cache"),
    }


def _convert(tmp_path, *args) -> subprocess.CompletedProcess:
    cmd = [str(MINDSPEED), "convert", *map(str, args)]
    return subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_tp2_run_from_an_hf_folder_converts_back_to_transformers(tmp_path):
    import transformers

    from mindspeed_llm.models.hf_io import load_model

    hf = models_hf.make_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    done = _convert(
        tmp_path,
        "--input",
        tmp_path / "hf",
        "--output",
        tmp_path / "ours",
        "--to",
        "mindspeed",
        "--tp",
        "2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "mindspeed_llm.pretrain", f"--model.hf_path={tmp_path / 'hf'}", "--parallel.tp=2"]
    cmd += ["--train.steps=3", "--train.micro_batch=2", "--train.global_batch=2"]
    cmd += ["--data.seq_len=32", "--optim.warmup_steps=0", "--train.eval_interval=0"]
    cmd += ["--logging.progress=false", "--logging.tensorboard=false", "--logging.log_interval=1"]
    cmd += [f"--logging.run_dir={run}"]
    done = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(read_metrics(run / "metrics.jsonl")) == 3
    assert (run / "checkpoints" / "step_3").is_dir()

    back = tmp_path / "back"
    done = _convert(tmp_path, "--input", run / "checkpoints", "--output", back, "--to", "hf")
    assert done.returncode == 0, done.stderr[-3000:]
    trained, _ = load_model(run / "checkpoints")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    ids = models_hf.tokens()
    with torch.no_grad():
        want = trained(ids)
        torch.testing.assert_close(reloaded(ids).logits, want, atol=1e-5, rtol=0)
        assert not torch.allclose(hf(ids).logits, want, atol=1e-3)  # it did train


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("hub", ["meta-llama/Llama-3.2-1B", "local folder"]),
        ("truncated", ["model.safetensors is truncated"]),
    ],
)
def test_the_command_reports_bad_input_on_one_line(tmp_path, case, fragments):
    if case == "hub":
        source = "meta-llama/Llama-3.2-1B"
    else:
        source = tmp_path / "hf"
        models_hf.make_hf("llama").save_pretrained(source)
        file = source / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-10])
    done = _convert(tmp_path, "--input", source, "--output", tmp_path / "out", "--to", "mindspeed")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]
