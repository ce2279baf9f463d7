"""The trainer starts from Hugging Face weights: `model.hf_path` (an HF folder) and
`checkpoint.load` of a converted checkpoint both give transformers' loss at step 1, and the
converted checkpoint (model only) starts a fresh run at step 0."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.trainer import Trainer
from mindspeed_tools.convert import hf_to_mindspeed

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")


def _first_loss(tmp_path, monkeypatch, *args, steps=1):
    """Step-1 loss of a `steps`-step run, and that run's first batch."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path.parent / "cache"))
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"--train.steps={steps}",
            "--train.micro_batch=2",
            "--train.global_batch=2",
            "--data.seq_len=32",
            "--data.reset_position_ids=false",  # transformers sees plain causal rows
            "--data.reset_attention_mask=false",
            "--optim.warmup_steps=0",
            "--train.eval_interval=0",
            "--logging.progress=false",
            "--logging.tensorboard=false",
            "--model.ops_impl=reference",
            f"--logging.run_dir={tmp_path / 'run'}",
            *args,
        ],
    )
    trainer = Trainer(cfg, init_distributed(device_type="cpu"))
    try:
        loader = trainer.data.loader
        position = loader.state_dict()
        batch = loader.next_micro_batch()
        loader.load_state_dict(position)
        summary = trainer.run()
    finally:
        destroy_distributed()
    assert summary["steps"] == steps
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records[0]["loss"], batch


def _hf_loss(hf, batch):
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.fixture
def hf_folder(tmp_path):
    hf = models_hf.make_hf("qwen2")
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def test_pretrain_from_hf_path_starts_at_transformers_loss(tmp_path, monkeypatch, hf_folder):
    hf, folder = hf_folder
    loss, batch = _first_loss(tmp_path / "a", monkeypatch, f"--model.hf_path={folder}")
    assert loss == pytest.approx(_hf_loss(hf, batch), abs=1e-4)


def test_a_converted_checkpoint_starts_a_fresh_run(tmp_path, monkeypatch, hf_folder):
    hf, folder = hf_folder
    ours = hf_to_mindspeed(folder, tmp_path / "ours")
    loss, batch = _first_loss(
        tmp_path / "b",
        monkeypatch,
        "--model.family=qwen2",
        f"--model.hf_config={ours}",
        f"--checkpoint.load={ours}",
    )
    assert loss == pytest.approx(_hf_loss(hf, batch), abs=1e-4)
    assert (tmp_path / "b" / "run" / "checkpoints" / "step_1").is_dir()
    # The same command again, one step longer: the run's own step_1 wins over
    # checkpoint.load (it continues, it does not start over from the converted weights).
    again, _ = _first_loss(
        tmp_path / "b",
        monkeypatch,
        "--model.family=qwen2",
        f"--model.hf_config={ours}",
        f"--checkpoint.load={ours}",
        steps=2,
    )
    assert again == loss  # step 1's record kept, step 2 appended once
    assert (tmp_path / "b" / "run" / "checkpoints" / "step_2").is_dir()


def test_a_run_without_hf_source_converts_to_transformers(tmp_path, monkeypatch):
    """A flavor-built run (no HF config anywhere): config.json is written from our config."""
    import transformers

    from mindspeed_llm.demo import cache_root, ensure_demo_data
    from mindspeed_llm.loading import load_model
    from mindspeed_tools.convert import mindspeed_to_hf

    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path.parent / "cache"))
    tokenizer = ensure_demo_data(cache_root()).tokenizer
    _first_loss(tmp_path, monkeypatch, "--model.family=qwen3", f"--data.tokenizer={tokenizer}")
    checkpoints = tmp_path / "run" / "checkpoints"
    back = mindspeed_to_hf(checkpoints, tmp_path / "back", dtype=torch.float32)
    assert (back / "generation_config.json").is_file()
    assert {p.name for p in back.glob("tokenizer.*")} == {f"tokenizer{Path(tokenizer).suffix}"}
    trained, _ = load_model(checkpoints)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    ids = models_hf.tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(ids), atol=1e-5, rtol=0)
