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

from mindspeed_align.common import check_layout, evaluating, warm_start_for_demo
from mindspeed_align.prm_data import PRMData
from mindspeed_align.reward import add_score_head
from mindspeed_align.rm import export_trained
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_core.optim import OptimConfig
from mindspeed_llm.data.collate import IGNORE_INDEX, forward_packed
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
    export_hf: Path | None = None
    """Write the trained model here at the end as a Hugging Face *ForTokenClassification folder
    with two labels (0 wrong, 1 right; None: only the run's checkpoints)."""


def _prm_train() -> TrainSection:
    return TrainSection(steps=1000, micro_batch=8, global_batch=16, eval_interval=0)


@dataclass(kw_only=True)
class PRMConfig(SFTConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=10))
    train: TrainSection = field(default_factory=_prm_train)
    logging: LoggingSection = field(
        default_factory=lambda: LoggingSection(run_dir=Path("runs/prm"))
    )
    prm: PRMSection = field(default_factory=PRMSection)
    """The step format."""

    def __post_init__(self):
        super().__post_init__()
        check_layout(self, "prm")
        self.parallel.loss_parallel = False  # a two-output head has no vocabulary to shard


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
        out = forward_packed(model, batch)
        labelled = batch["labels"] != IGNORE_INDEX
        correct += int((out.argmax(-1)[labelled] == batch["labels"][labelled]).sum())
        total += int(labelled.sum())
    return correct / max(total, 1)


def prm(cfg: PRMConfig) -> dict[str, float]:
    """Train a process reward model in this process (one rank of a torchrun job, or alone)."""
    from mindspeed_llm.train.trainer import Trainer

    with process_group(cfg.train.device) as info:
        start = warm_start_for_demo(cfg, info)
        trainer = Trainer(cfg, info, data=PRMData, objective=StepObjective(), command="prm",
                          before_tp=functools.partial(add_score_head, num_outputs=2))  # fmt: skip
        if start is not None:
            trainer.model.load_state_dict(
                {k: v for k, v in start.items() if k != "output.weight"}, strict=False
            )
        before = _demo_accuracy(trainer, cfg) if start is not None else None
        summary = trainer.run()
        if before is not None:
            summary.update(
                step_accuracy_before=before, step_accuracy_after=_demo_accuracy(trainer, cfg)
            )
            logger.info("held-out step accuracy: %.2f before, %.2f after",
                        summary["step_accuracy_before"], summary["step_accuracy_after"])  # fmt: skip
        if cfg.prm.export_hf is not None:
            export_trained(trainer, cfg.data, cfg.model, cfg.prm.export_hf, task="token")
        return summary


def _demo_accuracy(trainer, cfg) -> float | None:
    """Held-out step accuracy of the demo (one process)."""
    from mindspeed_align.prm_data import ensure_prm_demo, load_steps
    from mindspeed_llm.data.sft import collate_rows

    if trainer.dims.world_size > 1:
        return None
    data = trainer.data
    heldout = type(cfg.data)(paths=[ensure_prm_demo().heldout], seq_len=cfg.data.seq_len)
    samples = load_steps(heldout, data.tokenizer, cfg.prm.step_separator)[0]
    batches = [collate_rows([[s] for s in samples[i : i + 50]], cfg.data.seq_len, data.pad_id)
               for i in range(0, len(samples), 50)]  # fmt: skip
    with evaluating(trainer.model):
        return step_accuracy(trainer.model, batches)


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
