"""`mindspeed sft --lora.rank R` end to end: a LoRA fine-tune of a Hugging Face folder on
chat data trains and saves only the adapters, and leaves MindSpeed as a peft adapter that
`peft.PeftModel.from_pretrained` loads on the base with the logits `load_model` (what
generate, chat and eval use) gives for the run."""

import json
from pathlib import Path

import pytest
import torch

from mindspeed_core.cli import run as cli
from mindspeed_core.config import load_config
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.loading import load_model
from mindspeed_llm.models.checkpoint_io import tensor_metadata
from mindspeed_llm.sft import sft
from mindspeed_llm.train.sft_config import SFTConfig

LLM_TESTS = Path(__file__).resolve().parents[1] / "packages" / "mindspeed-llm" / "tests"
sft_tests = import_sibling(str(LLM_TESTS / "conftest.py"), "test_sft_train")
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")


def test_lora_sft_trains_adapters_only_and_exports_to_peft(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    folder, data = sft_tests.make_run_inputs(tmp_path, n=16)
    run = tmp_path / "run"
    args = sft_tests.run_args(folder, data, run, "--data.mode=pack", "--train.steps=6",
                              "--train.micro_batch=4", "--train.global_batch=4",
                              "--optim.lr=2e-2", "--lora.rank=4", "--lora.alpha=8",
                              "--lora.targets=[q_proj,v_proj,down_proj]")  # fmt: skip
    sft(load_config(SFTConfig, None, args))
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]
    saved = tensor_metadata(run / "checkpoints" / "step_6")
    assert saved and all(".lora_" in name for name in saved)  # the frozen base is not saved

    out = tmp_path / "adapter"
    assert cli(["convert", "--input", str(run / "checkpoints"), "--output", str(out),
                "--to", "peft"]) == 0  # fmt: skip
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = models_hf.tokens()
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
        ours, _ = load_model(run / "checkpoints", ops_impl="reference")
        torch.testing.assert_close(ours.eval()(ids), adapted, atol=1e-5, rtol=1e-5)
    assert (adapted - before).abs().max() > 1e-3  # the adapters changed the model


@pytest.mark.slow
def test_muon_on_lora_adapters_only_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Muon orthogonalises the blocks' weights, which LoRA freezes: nothing is left for it."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    folder, data = sft_tests.make_run_inputs(tmp_path, n=16)
    run = tmp_path / "run"
    args = sft_tests.run_args(folder, data, run, "--lora.rank=4", "--optim.name=muon")
    capsys.readouterr()  # the Hugging Face folder's progress bars
    assert cli(["sft", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the run's log lines, then the error
    errors = [line for line in err if line.startswith("error: ")]
    assert errors == [err[-1]] and "optim.name=muon: no trainable hidden matrix" in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
