"""`mindspeed prm` / `python -m mindspeed_align.prm`: train a process reward model.

A process reward model scores every step of a solution. The model is the decoder with a
two-output head (`reward.add_score_head` with `num_outputs=2`: wrong, right; transformers'
`*ForTokenClassification` with two labels, as TRL's PRMTrainer trains it), the data stepwise
records (`prm_data`: the label of a step sits at the last token of the separator that ends it),
and the loss `StepObjective`: cross entropy at those positions only, the mean over the step's
labelled steps. metrics.jsonl adds `accuracy` (TRL's name: the fraction of steps whose argmax
is the label). Every section but `prm` is `mindspeed sft`'s; `train.micro_batch` counts rows.

With no arguments it fine-tunes the debug Llama on the SFT demo (DPO's warm start), trains the
PRM on generated three-step answers to the demo's counting questions (each step wrong with
probability 0.4) and prints the held-out step accuracy before and after.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mindspeed_align.prm_data import PRMData
from mindspeed_align.reward import add_score_head
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import current_distributed, destroy_distributed, init_distributed
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_llm.data.collate import IGNORE_INDEX
from mindspeed_llm.train.config import LoggingSection, TrainSection
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective
from mindspeed_llm.train.sft_config import SFTConfig

__all__ = ["PRMConfig", "PRMSection", "StepObjective", "command", "prm", "step_accuracy"]

logger = logging.getLogger("mindspeed.prm")


@dataclass(kw_only=True)
class PRMSection:
    step_separator: str = "\n"
    """Appended to every step; the step's label is read at its last token (TRL's name and
    default)."""


def _prm_train() -> TrainSection:
    return TrainSection(steps=200, micro_batch=8, global_batch=16, eval_interval=0)


@dataclass(kw_only=True)
class PRMConfig(SFTConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=10))
    train: TrainSection = field(default_factory=_prm_train)
    logging: LoggingSection = field(
        default_factory=lambda: LoggingSection(run_dir=Path("runs/prm"))
    )
    prm: PRMSection = field(default_factory=PRMSection)
    """The step format."""

    def __post_init__(self):
        super().__post_init__()
        if self.parallel.cp > 1 or self.parallel.pp > 1:
            raise ConfigError(f"prm: parallel.cp={self.parallel.cp}, parallel.pp={self.parallel.pp}: "
                              "context and pipeline parallel are not supported yet (tp and dp are)")  # fmt: skip
        self.parallel.loss_parallel = False  # a two-output head has no vocabulary to shard
        if self.lora.rank:
            raise ConfigError(
                "prm: lora.rank > 0 is not supported yet (the head would need training too)"
            )


class StepObjective(Objective):
    """Labelled steps are the units: a micro-batch's loss is the sum of their cross entropies
    (labels aligned with the ids: 0 wrong, 1 right, -100 not a step end)."""

    metric_names = ("accuracy",)

    def num_units(self, batch):
        return (batch["labels"] != IGNORE_INDEX).sum()

    def targets(self, batch):
        return {"labels": batch["labels"]}

    def loss(self, outputs, targets, ctx: LossContext) -> LossOutput:
        logits, labels = outputs.flatten(0, -2).float(), targets["labels"].flatten()
        nll = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
        return LossOutput(nll, {"accuracy": correct.detach().float()})


@torch.no_grad()
def step_accuracy(model, batches) -> float:
    """The fraction of labelled steps of `batches` whose argmax is their label."""
    correct = total = 0
    for batch in batches:
        out = model(
            batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"]
        )
        labelled = batch["labels"] != IGNORE_INDEX
        correct += int((out.argmax(-1)[labelled] == batch["labels"][labelled]).sum())
        total += int(labelled.sum())
    return correct / max(total, 1)


def prm(cfg: PRMConfig) -> dict[str, float]:
    """Train a process reward model in this process (one rank of a torchrun job, or alone)."""
    import torch.distributed as dist

    from mindspeed_llm.train.trainer import Trainer

    demo = not cfg.data.paths
    owns_group = not dist.is_initialized()
    device = None if cfg.train.device == "auto" else cfg.train.device
    info = init_distributed(device_type=device) if owns_group else current_distributed(device)
    try:
        start = None
        if demo:
            from mindspeed_align.dpo_demo import warm_start

            start = warm_start(cfg, info)
        trainer = Trainer(cfg, info, data=PRMData, objective=StepObjective(), command="prm",
                          before_tp=functools.partial(add_score_head, num_outputs=2))  # fmt: skip
        if start is not None:
            trainer.model.load_state_dict(
                {k: v for k, v in start.items() if k != "output.weight"}, strict=False
            )
        before = _demo_accuracy(trainer, cfg) if demo else None
        summary = trainer.run()
        if before is not None:
            summary.update(
                step_accuracy_before=before, step_accuracy_after=_demo_accuracy(trainer, cfg)
            )
            logger.info("held-out step accuracy: %.2f before, %.2f after",
                        summary["step_accuracy_before"], summary["step_accuracy_after"])  # fmt: skip
        return summary
    finally:
        if owns_group:
            destroy_distributed()


def _demo_accuracy(trainer, cfg) -> float | None:
    """Held-out step accuracy of the demo (one process)."""
    from mindspeed_align.prm_data import ensure_prm_demo, load_steps
    from mindspeed_llm.data.sft import collate_rows

    if trainer.dims.world_size > 1:
        return None
    data = trainer.data
    heldout = ensure_prm_demo().heldout
    samples = load_steps(type(cfg.data)(paths=[heldout], seq_len=cfg.data.seq_len), data.tokenizer,
                         cfg.prm.step_separator)[0]  # fmt: skip
    batches = [collate_rows([[s] for s in samples[i : i + 50]], cfg.data.seq_len, data.pad_id)
               for i in range(0, len(samples), 50)]  # fmt: skip
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        return step_accuracy(trainer.model, batches)
    finally:
        trainer.model.train(was_training)


command = config_command(
    "prm",
    PRMConfig,
    prm,
    help="train a process reward model on stepwise data (no arguments: the embedded demo)",
    demo="SFT of a debug Llama, then a process reward model on generated counting steps (CPU, a few minutes).",
)
main = command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
