"""`mindspeed convert` end to end: an HF model trained under tp=2 by `mindspeed pretrain
--model.hf_path` converts back to a folder transformers loads, and the real command turns
bad input into one line and exit code 2, leaving nothing behind."""

from pathlib import Path

import pytest
import torch

from mindspeed_core.testing import import_sibling

ROOT = Path(__file__).resolve().parents[1]
models_hf = import_sibling(str(ROOT / "packages/mindspeed-llm/tests/conftest.py"), "models_hf")
pytestmark = pytest.mark.distributed
# 3 steps of 2 x 2 sequences of 32 tokens, no warmup, no validation
SHORT = ["--train.steps=3", "--train.global_batch=4", "--data.seq_len=32"]
SHORT += ["--optim.warmup_steps=0", "--train.eval_interval=0"]


@pytest.mark.slow
def test_tp2_and_fsdp_runs_start_from_hf_weights_and_convert_back(torchrun, mindspeed, tmp_path):
    """tp=2 from `model.hf_path`, FSDP over 2 ranks from the converted checkpoint: the same
    step-1 loss (the HF model's), and each run's checkpoint converts back to transformers."""
    import transformers

    from mindspeed_llm.loading import load_model

    hf = models_hf.make_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    ours = tmp_path / "ours"
    done = mindspeed(
        "convert", "--input", tmp_path / "hf", "--output", ours, "--to", "mindspeed", "--tp", "2"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    layouts = {
        "tp2": [f"--model.hf_path={tmp_path / 'hf'}", "--parallel.tp=2"],
        "fsdp2": [
            f"--model.hf_config={ours}",
            f"--checkpoint.load={ours}",
            "--parallel.dp_shard=2",
        ],
    }
    first = {}
    ids = models_hf.tokens()
    for name, args in layouts.items():
        run = tmp_path / name
        records = torchrun(2, run, *SHORT, *args)
        assert [r["step"] for r in records] == [1, 2, 3]
        first[name] = records[0]["loss"]
        back = tmp_path / f"{name}-hf"
        done = mindspeed("convert", "--input", run / "checkpoints", "--output", back, "--to", "hf")
        assert done.returncode == 0, done.stderr[-3000:]
        trained, _ = load_model(run / "checkpoints")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            back, attn_implementation="eager"
        )
        with torch.no_grad():
            want = trained(ids)
            torch.testing.assert_close(reloaded(ids).logits, want, atol=1e-5, rtol=0)
            assert not torch.allclose(hf(ids).logits, want, atol=1e-3)  # it did train
    assert first["tp2"] == pytest.approx(first["fsdp2"], rel=1e-4)


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("hub", ["meta-llama/Llama-3.2-1B", "local folder"]),
        ("truncated", ["model.safetensors is truncated"]),
    ],
)
def test_the_command_reports_bad_input_on_one_line(mindspeed, tmp_path, case, fragments):
    if case == "hub":
        source = "meta-llama/Llama-3.2-1B"
    else:
        source = tmp_path / "hf"
        models_hf.make_hf("llama").save_pretrained(source)
        file = source / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-10])
    done = mindspeed(
        "convert", "--input", source, "--output", tmp_path / "out", "--to", "mindspeed"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]
