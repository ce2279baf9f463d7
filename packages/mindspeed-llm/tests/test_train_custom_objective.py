"""A new objective is a small class, not a new trainer: a per-token-weighted next-token
loss (later tokens of each document count more) trains through the shared loop with
checkpoints, resumes exactly, and its step-1 loss is the weighted mean computed by hand."""

import torch
import torch.nn.functional as F

from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective, token_nll
from mindspeed_llm.train.trainer import Trainer


# -- the objective: everything a user writes ----------------------------------------------
class PositionWeighted(Objective):
    """Cross entropy weighted by 1 + position in the document; loss = sum w*nll / sum w."""

    metric_names = ("nll",)

    def weights(self, batch):
        return ((batch["position_ids"] + 1) * (batch["labels"] != -100)).float()

    def num_units(self, batch):
        return self.weights(batch).sum()

    def targets(self, batch):
        return {"labels": batch["labels"], "weights": self.weights(batch)}

    def loss(self, outputs, targets, ctx: LossContext) -> LossOutput:
        nll = token_nll(outputs, targets["labels"], ctx, reduction="none")
        weights = targets["weights"].flatten()
        return LossOutput((nll * weights).sum(), {"nll": (nll.detach() * weights).sum()})


# -- the test -------------------------------------------------------------------------------
def _train(tmp_path, run, *extra):
    args = ["--train.steps=4", "--train.micro_batch=2", "--train.global_batch=4",
            "--data.seq_len=32", "--optim.warmup_steps=1", "--train.eval_interval=2",
            "--checkpoint.interval=2", "--logging.log_interval=1", "--logging.progress=false",
            "--logging.tensorboard=false", "--model.ops_impl=reference",
            f"--logging.run_dir={tmp_path / run}", *extra]  # fmt: skip
    trainer = Trainer(load_config(PretrainConfig, None, args), init_distributed(device_type="cpu"),
                      objective=PositionWeighted())  # fmt: skip
    try:
        first = trainer.data.next_step()
        trainer.data.load_state_dict({"consumed_samples": 0})
        oracle = _oracle(trainer.model, first)
        trainer.run()
    finally:
        destroy_distributed()
    return read_metrics(tmp_path / run / "metrics.jsonl"), oracle


def _oracle(model, micro_batches):
    """The weighted mean over the step's tokens, from one forward of the untouched model."""
    total = weight = 0.0
    with torch.no_grad():
        for b in micro_batches:
            logits = model(b["input_ids"], b["position_ids"], b["cu_seqlens"])
            nll = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
            w = PositionWeighted().weights(b).flatten()
            total, weight = total + (nll * w).sum().item(), weight + w.sum().item()
    return total / weight


def test_a_custom_objective_trains_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    straight, oracle = _train(tmp_path, "straight")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert abs(straight[0]["loss"] - oracle) < 1e-5
    assert straight[0]["nll"] == straight[0]["loss"]  # the metric is the same weighted sum
    assert straight[-1]["loss"] < straight[0]["loss"] and "valid_loss" in straight[1]
    _train(tmp_path, "resumed", "--train.exit_at_step=2")
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text().strip() == "step_2"
    resumed, _ = _train(tmp_path, "resumed")
    keys = ("loss", "grad_norm", "valid_loss", "nll")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [
        {k: r.get(k) for k in keys} for r in straight
    ]
