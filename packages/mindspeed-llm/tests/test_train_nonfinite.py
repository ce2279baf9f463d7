"""A step with an inf/nan loss is skipped and counted; K in a row stop the run clearly."""

import math

import pytest

from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.objectives import LossOutput, NextToken
from mindspeed_llm.train.trainer import Trainer, TrainingError


class _Poisoned(NextToken):
    """Next-token loss, nan on the steps in `bad_steps` (a test double of a diverging run)."""

    def __init__(self, bad_steps):
        super().__init__()
        self.bad_steps, self.trainer = bad_steps, None

    def loss(self, outputs, targets, ctx):
        out = super().loss(outputs, targets, ctx)
        if self.trainer.state.step + 1 in self.bad_steps:
            return LossOutput(out.loss_sum * math.nan)
        return out


def _trainer(tmp_path, monkeypatch, bad_steps, steps=6):
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"--train.steps={steps}",
            "--train.micro_batch=2",
            "--train.global_batch=2",
            "--data.seq_len=32",
            "--optim.warmup_steps=1",
            "--train.eval_interval=0",
            "--train.max_nonfinite_steps=3",
            "--logging.log_interval=1",
            "--logging.progress=false",
            "--logging.tensorboard=false",
            f"--logging.run_dir={tmp_path / 'run'}",
        ],
    )
    objective = _Poisoned(bad_steps)
    trainer = Trainer(cfg, init_distributed(device_type="cpu"), objective=objective)
    objective.trainer = trainer
    return trainer


def test_one_bad_step_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, monkeypatch, bad_steps={3})
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        summary = trainer.run()
    finally:
        destroy_distributed()
    assert summary["steps"] == 6 and trainer.state.extra["nonfinite_total"] == 1
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (1, 2, 4, 5, 6))
    assert any((p != before[n]).any() for n, p in trainer.model.named_parameters())


def test_three_bad_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, monkeypatch, bad_steps={2, 3, 4})
    try:
        with pytest.raises(TrainingError, match="inf/nan for 3 steps in a row \\(up to step 4\\)"):
            trainer.run()
    finally:
        destroy_distributed()
