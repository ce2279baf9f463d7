"""Reward models: the Bradley-Terry loss against TRL's RewardTrainer, `mindspeed rm`'s first step
against separate forwards, the Hugging Face export against transformers' sequence classifier,
tp=2 against one process, bad input, and (slow) the demo's accuracy goal."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from mindspeed_align.losses import reward_loss
from mindspeed_align.pairs import PairData
from mindspeed_align.reward import RewardObjective, add_score_head
from mindspeed_align.rm import RMConfig, export_trained, main, rm
from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.trainer import Trainer

dpo_tests = import_sibling(__file__, "test_dpo")

CHOSEN = torch.tensor([1.5, -0.3, 0.2, 2.0])
REJECTED = torch.tensor([0.5, 0.4, -1.2, 2.5])
MARGIN = torch.tensor([0.0, 0.5, 1.0, -0.5])
# (margin, center coefficient) -> TRL 1.16 RewardTrainer.compute_loss on CHOSEN/REJECTED
LOSS_TABLE = [(None, None, 0.6527355909347534), (MARGIN, None, 0.7456766366958618),
              (None, 0.01, 0.715885579586029), (MARGIN, 0.01, 0.8088266253471375)]  # fmt: skip


def trl_reward_loss(chosen, rejected, margin, center):
    """TRL's own `RewardTrainer.compute_loss` on a stand-in model whose scores are given."""
    from trl import RewardTrainer

    acc = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=acc, _total_train_tokens=0,
                           _tp_size=1, args=SimpleNamespace(center_rewards_coefficient=center),
                           _metrics={"train": {k: [] for k in ("num_tokens", "min_reward", "mean_reward",
                                                                 "max_reward", "accuracy", "margin")}})  # fmt: skip
    logits = torch.cat([chosen, rejected])[:, None]
    inputs = {"attention_mask": torch.ones(len(logits), 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    loss = RewardTrainer.compute_loss(fake, lambda **kw: SimpleNamespace(logits=logits), inputs)
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("margin,center,expected", LOSS_TABLE)
def test_reward_loss_equals_trl(margin, center, expected):
    ours = reward_loss(CHOSEN, REJECTED, margin=margin, center_coefficient=center).mean()
    assert float(ours) == pytest.approx(expected, rel=1e-6)
    pytest.importorskip("trl")
    theirs, metrics = trl_reward_loss(CHOSEN, REJECTED, margin, center)
    assert float(ours) == pytest.approx(theirs, rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(0.5) and metrics["margin"] == pytest.approx(0.3)


def _alone_score(model, ids, pad_id):
    """A sequence's score from its own forward: the head at its last token that is not pad."""
    ids = torch.as_tensor(ids)
    last = int(torch.nonzero(ids != pad_id).max())
    out = model(ids[None], position_ids=torch.arange(len(ids))[None],
                cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32))  # fmt: skip
    return out[0, last, 0].float()


def _hf_scores(folder, seqs):
    """transformers' AutoModelForSequenceClassification on right-padded rows of `seqs`."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32
    )
    pad = model.config.pad_token_id
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.as_tensor(s), 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def test_first_step_and_hf_export(tmp_path):
    """The first step's loss and metrics are the pure loss of separately computed scores; after
    it, the exported *ForSequenceClassification gives the model's scores (1e-5)."""
    folder, data = dpo_tests.make_inputs(tmp_path)
    args = dpo_tests.run_args(folder, data, tmp_path / "run", "--train.steps=2", "--train.micro_batch=4",
                              "--train.global_batch=8", "--rm.center_rewards_coefficient=0.01",
                              f"--rm.export_hf={tmp_path / 'hf'}")  # fmt: skip
    cfg = load_config(RMConfig, None, args)
    info = init_distributed(device_type="cpu")
    try:
        objective = RewardObjective(pad_id=0, center_coefficient=0.01)
        trainer = Trainer(
            cfg, info, data=PairData, objective=objective, before_tp=add_score_head, command="rm"
        )
        pad = objective.pad_id  # read from the data by the objective's setup
        assert pad == trainer.data.pad_id
        micro_batches = trainer.data.next_step()
        seqs = [s[0] for i in range(8) for s in trainer.data._row(i)]
        with torch.no_grad():
            first = torch.stack([_alone_score(trainer.model, s, pad) for s in seqs])
        result = trainer.step(micro_batches)
        with torch.no_grad():
            after = torch.stack([_alone_score(trainer.model, s, pad) for s in seqs])
        export_trained(trainer, cfg.data, cfg.model, cfg.rm.export_hf)
    finally:
        destroy_distributed()
    chosen, rejected = first[0::2], first[1::2]
    assert result.loss == pytest.approx(
        float(reward_loss(chosen, rejected, center_coefficient=0.01).mean()), rel=1e-5
    )
    assert result.metrics["accuracy"] == pytest.approx(float((chosen > rejected).float().mean()))
    assert result.metrics["margin"] == pytest.approx(
        float((chosen - rejected).mean()), rel=1e-5, abs=1e-6
    )
    assert not torch.allclose(after, first)  # the step changed the scores the export must carry
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        hf_config["architectures"] == ["LlamaForSequenceClassification"]
        and hf_config["num_labels"] == 1
    )
    pytest.importorskip("transformers")
    torch.testing.assert_close(_hf_scores(tmp_path / "hf", seqs), after, rtol=1e-5, atol=1e-5)


def _tp2(folder, data, root):
    rm(load_config(RMConfig, None, dpo_tests.run_args(folder, data, root / "tp", "--train.steps=3",
       "--train.micro_batch=4", "--train.global_batch=4", "--parallel.tp=2")))  # fmt: skip
    return read_metrics(root / "tp" / "metrics.jsonl")


@pytest.mark.distributed
def test_tp2_equals_one_process_and_the_command(tmp_path, capsys):
    """`mindspeed rm` through its command line, then tp=2 (the head kept whole) = one process;
    bad input is one line, exit 2, nothing written."""
    folder, data = dpo_tests.make_inputs(tmp_path, n=8)
    args = dpo_tests.run_args(folder, data, tmp_path / "one", "--train.steps=3", "--train.micro_batch=4",
                              "--train.global_batch=4")  # fmt: skip
    assert guarded(main, args) == 0
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert len(one) == 3 and {"accuracy", "margin", "mean_reward"} <= set(one[0])
    tp = run_distributed(_tp2, 2, folder, data, tmp_path, timeout=600)[0]
    for key in ("loss", "accuracy", "margin", "mean_reward", "grad_norm"):
        torch.testing.assert_close(
            [m[key] for m in tp], [m[key] for m in one], rtol=1e-4, atol=1e-5, msg=key
        )
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}) + "\n")
    cases = [([], tmp_path / "missing.jsonl", r"does not exist: .*missing.jsonl"),
             ([], same, r"same.jsonl:1: chosen and rejected are the same reply"),
             (["--rm.center_rewards_coefficient=-1"], data, r"rm.center_rewards_coefficient=-1.0 must be >= 0"),
             (["--parallel.pp=2"], data, r"rm: parallel.cp=1, parallel.pp=2")]  # fmt: skip
    capsys.readouterr()
    for extra, path, message in cases:
        run_dir = tmp_path / "bad"
        assert guarded(main, dpo_tests.run_args(folder, path, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[-1]), err
        assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_demo_reward_model_accuracy(tmp_path, monkeypatch):
    """`mindspeed rm` with no arguments: SFT warm start, then the reward model on the demo pairs."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    cfg = load_config(
        RMConfig, None, [f"--logging.run_dir={tmp_path / 'run'}", "--logging.progress=false"]
    )
    summary = rm(cfg)
    assert (
        summary["accuracy_after"] > 0.9
        and summary["accuracy_after"] > summary["accuracy_before"] + 0.2
    )
