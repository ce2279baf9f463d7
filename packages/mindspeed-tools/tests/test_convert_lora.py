"""A LoRA run's adapter-only checkpoints leave MindSpeed three ways, each checked against
the adapter model (base + adapters, unmerged) on the same tokens: `convert --merge-lora`
gives a Hugging Face folder whose transformers logits are the adapter model's (1e-5);
`convert --to peft` gives a folder `peft.PeftModel.from_pretrained` loads on the base with
the same logits; `load_model` (what generate, chat and eval use) merges on load."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from mindspeed_core.cli import run as cli
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.loading import checkpoint_source, load_model
from mindspeed_llm.models import Transformer
from mindspeed_llm.peft import LoRAConfig, lora_trainer_options
from mindspeed_llm.peft.checkpoint import load_adapter_weights
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.trainer import Trainer

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")


@dataclass(kw_only=True)
class LoRAPretrainConfig(PretrainConfig):
    """Pretraining with a `lora` section (what `mindspeed sft` takes as `lora:`)."""

    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapters; rank 0: full training."""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step LoRA run (rank 4, rsLoRA, every linear) from a tiny Llama folder."""
    root = tmp_path_factory.mktemp("lora")
    models_hf.make_hf("llama").save_pretrained(root / "base")
    args = ["--train.steps=2", "--train.micro_batch=2", "--train.global_batch=2",
            "--data.seq_len=32", "--optim.warmup_steps=0", "--optim.lr=2e-2",
            "--train.eval_interval=0", "--logging.progress=false", "--logging.tensorboard=false",
            "--model.ops_impl=reference", f"--model.hf_path={root / 'base'}",
            f"--logging.run_dir={root / 'run'}", "--lora.rank=4", "--lora.alpha=8",
            "--lora.rslora=true"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINDSPEED_CACHE", str(root / "cache"))
        cfg = load_config(LoRAPretrainConfig, None, args)
        trainer = Trainer(
            cfg, init_distributed(device_type="cpu"), **lora_trainer_options(cfg.lora)
        )
        try:
            trainer.run()
        finally:
            destroy_distributed()
    checkpoints = root / "run" / "checkpoints"
    first_loss = read_metrics(root / "run" / "metrics.jsonl")[0]["loss"]
    source = checkpoint_source(checkpoints)
    model = Transformer(source.config)
    load_adapter_weights(model, source.path, source.weights, source.config, cfg.lora)
    ids = models_hf.tokens()
    with torch.no_grad():
        logits = model.eval()(ids)
    b = model.layers["0"].attention.wq.lora_B.weight
    assert b.abs().sum() > 0  # the adapters trained: merging them changes the model
    return root, checkpoints, ids, logits, first_loss, args


def test_merge_lora_writes_a_transformers_folder_with_the_adapter_logits(lora_run, tmp_path):
    root, checkpoints, ids, logits, *_ = lora_run
    out = tmp_path / "merged"
    assert cli(["convert", "--input", str(checkpoints), "--output", str(out), "--to", "hf",
                "--merge-lora"]) == 0  # fmt: skip
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, logits, atol=1e-5, rtol=1e-5)
        assert (base(ids).logits - logits).abs().max() > 1e-3  # not the base's


def test_to_peft_loads_in_peft_with_the_adapter_logits(lora_run, tmp_path):
    peft = pytest.importorskip("peft")
    root, checkpoints, ids, logits, *_ = lora_run
    out = tmp_path / "adapter"
    assert cli(["convert", "--input", str(checkpoints), "--output", str(out), "--to", "peft"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8, True)
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits, atol=1e-5, rtol=1e-5)


def test_load_model_of_a_lora_run_is_the_merged_adapter_model(lora_run, capsys):
    _, checkpoints, ids, logits, *_ = lora_run
    model, _ = load_model(checkpoints, ops_impl="reference")
    assert not any("lora_" in n for n, _ in model.named_parameters())  # merged on load
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, atol=1e-5, rtol=1e-5)
    assert cli(["generate", "--model", str(checkpoints), "--max-new-tokens", "4", "a b"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(record["token_ids"]) == 4


@pytest.mark.parametrize("case", ["merge_a_full_model", "plain_to_hf_of_a_lora_run"])
def test_bad_lora_exports_are_one_line(case, lora_run, tmp_path, capsys):
    root, checkpoints, *_ = lora_run
    if case == "merge_a_full_model":
        converted = tmp_path / "converted"
        assert cli(["convert", "--input", str(root / "base"), "--output", str(converted),
                    "--to", "mindspeed"]) == 0  # fmt: skip
        argv, message = [str(converted), "--to", "hf", "--merge-lora"], "is not a LoRA run"
    else:
        argv, message = [str(checkpoints), "--to", "hf"], "add --merge-lora, or use --to peft"
    capsys.readouterr()
    out = tmp_path / "out"
    assert cli(["convert", "--input", *argv[:1], "--output", str(out), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not out.exists()


def test_a_lora_run_from_a_converted_checkpoint_takes_its_base_from_it(lora_run, tmp_path):
    """checkpoint.load of a converted (model-only) checkpoint fills the frozen base; the run
    starts at the hf_path run's loss, and its checkpoints export with that base."""
    root, _, ids, _, first_loss, args = lora_run
    converted = tmp_path / "converted"
    assert cli(["convert", "--input", str(root / "base"), "--output", str(converted),
                "--to", "mindspeed"]) == 0  # fmt: skip
    args = [a for a in args if not a.startswith(("--model.hf_path", "--logging.run_dir"))]
    args += ["--model.family=llama", f"--model.hf_config={converted}",
             f"--checkpoint.load={converted}", f"--logging.run_dir={tmp_path / 'run'}"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINDSPEED_CACHE", str(root / "cache"))
        cfg = load_config(LoRAPretrainConfig, None, args)
        trainer = Trainer(
            cfg, init_distributed(device_type="cpu"), **lora_trainer_options(cfg.lora)
        )
        try:
            trainer.run()
        finally:
            destroy_distributed()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["loss"] == first_loss
    model, _ = load_model(tmp_path / "run" / "checkpoints", ops_impl="reference")
    merged = tmp_path / "merged"
    assert cli(["convert", "--input", str(tmp_path / "run" / "checkpoints"), "--output",
                str(merged), "--to", "hf", "--merge-lora"]) == 0  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
