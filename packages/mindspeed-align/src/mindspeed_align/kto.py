"""`mindspeed kto` / `python -m mindspeed_align.kto`: KTO on unpaired desirable/undesirable data.

KTO is the shared trainer with unpaired examples as data (`kto_data.KTOData`: each example and
its mismatched KL sequence in one packed row) and `KTOObjective`: one policy forward per
micro-batch gives every sequence's log-prob, the frozen reference (built in `KTOObjective.setup`) its
own, and the loss is `losses.kto_loss` with the reference point `losses.kto_kl_estimate`: the
mean log-ratio of the mismatched sequences, detached and averaged over the data-parallel ranks
(TRL's KTOTrainer gathers it the same way). Every section but `data` and `kto` is SFT's.
metrics.jsonl gets TRL's names: rewards/chosen, rewards/rejected (means over the step's
desirable / undesirable examples), rewards/margins, logps/chosen, logps/rejected, kl, and
count/chosen, count/rejected (examples of the step).

With no arguments it fine-tunes the debug Llama on the SFT demo (DPO's warm start), then runs
KTO on the DPO demo's pairs split into unpaired examples (chosen: label true, rejected: label
false) and prints the held-out implicit-reward accuracy on the pairs before and after.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from mindspeed_align.common import check_layout, warm_start_for_demo
from mindspeed_align.dpo import PreferenceObjective
from mindspeed_align.kto_data import LABEL_KEY, KTOData
from mindspeed_align.logps import SLOT_KEY, sequence_logps
from mindspeed_align.losses import kto_kl_estimate, kto_loss
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_llm.train.config import LoggingSection, TrainSection
from mindspeed_llm.train.objectives import LossContext, LossOutput
from mindspeed_llm.train.sft_config import SFTConfig
from mindspeed_ops.validate import host_values

__all__ = ["KTOConfig", "KTOObjective", "KTOSection", "command", "kto"]

logger = logging.getLogger("mindspeed.kto")

SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "count/chosen",
        "count/rejected", "kl")  # fmt: skip
"""What the loss sums per micro-batch (`finish_metrics` turns them into TRL's means)."""


@dataclass(kw_only=True)
class KTOSection:
    beta: float = 0.1
    """β of the implicit reward β·(logπ − logπref) (TRL's name)."""
    desirable_weight: float = 1.0
    """λ_D: weight of the desirable examples' losses (TRL's name)."""
    undesirable_weight: float = 1.0
    """λ_U: weight of the undesirable examples' losses (TRL's name; the KTO paper advises
    λ_D·n_D / (λ_U·n_U) in [1, 4/3])."""

    def __post_init__(self):
        if self.beta <= 0:
            raise ConfigError(f"kto.beta={self.beta} must be positive")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kto.{name}={getattr(self, name)} must be positive")

    uses_reference = True
    """KTO always reads a reference model (`PreferenceObjective.targets`)."""


def _kto_train() -> TrainSection:
    return TrainSection(steps=200, micro_batch=8, global_batch=16, eval_interval=0)


@dataclass(kw_only=True)
class KTOConfig(SFTConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=10))
    train: TrainSection = field(default_factory=_kto_train)
    logging: LoggingSection = field(
        default_factory=lambda: LoggingSection(run_dir=Path("runs/kto"))
    )
    kto: KTOSection = field(default_factory=KTOSection)
    """The KTO method (β, desirable and undesirable weights)."""

    def __post_init__(self):
        super().__post_init__()
        check_layout(self, "kto")
        if self.train.micro_batch < 2:
            raise ConfigError(f"kto: train.micro_batch={self.train.micro_batch}: the KL estimate pairs each "
                              "prompt with another example's completion of the micro-batch; use 2 or more")  # fmt: skip


class KTOObjective(PreferenceObjective):
    """Unpaired examples are the units; a micro-batch's loss is the sum of its examples'.

    Args:
        section: the `kto` config section.
        kl_group: the data-parallel process group the KL estimate is averaged over (None:
            this process alone; `setup` sets it). `setup` builds the reference unless given.
    """

    metric_names = SUMS

    def __init__(self, section: KTOSection, reference=None, reference_ctx: LossContext | None = None,
                 kl_group=None, *, reference_after_tp=None):  # fmt: skip
        super().__init__(section, reference, reference_ctx)
        self.kl_group = kl_group
        self.reference_after_tp = reference_after_tp

    def setup(self, run) -> None:
        """The frozen reference (the run's starting model, adapters by `reference_after_tp`)
        and the data-parallel group the KL estimate is averaged over."""
        if self.reference is None:
            reference = run.starting_policy(after_tp=self.reference_after_tp)
            self.reference, self.reference_ctx = reference.model, reference.loss
        mesh = run.dims.mesh("dp")
        self.kl_group = None if mesh is None else mesh.get_group()
        from mindspeed_llm.train.step import supervised_positions_layout

        self.reference_keep = supervised_positions_layout(run.policy, run.dims)
        self.fused_reference = self.reference_keep and run.cfg.train.fused_linear_cross_entropy != "off"

    def targets(self, batch):
        return {**super().targets(batch), LABEL_KEY: batch[LABEL_KEY]}

    def loss(self, outputs, targets, ctx: LossContext) -> LossOutput:
        s = self.section
        num_slots = host_values(targets["num_slots"])  # whole: kept positions may miss a slot's
        logps = sequence_logps(outputs, targets["labels"], targets[SLOT_KEY], num_slots, ctx)[0]
        ref, labels = targets["ref_logps"], targets[LABEL_KEY].bool()
        kl = kto_kl_estimate(logps[1::2], ref[1::2], group=self.kl_group)
        out = kto_loss(logps[0::2], ref[0::2], labels, kl, beta=s.beta, desirable_weight=s.desirable_weight,
                       undesirable_weight=s.undesirable_weight)  # fmt: skip
        policy = logps[0::2].detach()
        values = (out.chosen_rewards.sum(), out.rejected_rewards.sum(), policy[labels].sum(), policy[~labels].sum(),
                  labels.sum(), (~labels).sum(), kl * labels.numel())  # fmt: skip
        return LossOutput(
            out.losses.sum(), {k: v.float() for k, v in zip(SUMS, values, strict=True)}
        )

    def finish_metrics(self, metrics: dict[str, float], units: float) -> dict[str, float]:
        """Means over the step's desirable / undesirable examples (TRL's), leaving out a side
        the step has none of, as TRL does."""
        out = {k: v for k, v in metrics.items() if k not in SUMS}
        out["kl"] = metrics["kl"]
        for side in ("chosen", "rejected"):
            count = metrics[f"count/{side}"]
            out[f"count/{side}"] = round(count * units)
            if count > 0:
                out[f"rewards/{side}"] = metrics[f"rewards/{side}"] / count
                out[f"logps/{side}"] = metrics[f"logps/{side}"] / count
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def kto(cfg: KTOConfig, *, before_tp=None, after_tp=None) -> dict[str, float]:
    """Run KTO in this process (one rank of a torchrun job, or alone)."""
    from mindspeed_llm.train.trainer import Trainer

    with process_group(cfg.train.device) as info:
        start = warm_start_for_demo(cfg, info)
        objective = KTOObjective(cfg.kto, reference_after_tp=after_tp)
        trainer = Trainer(cfg, info, data=KTOData, objective=objective, before_tp=before_tp, after_tp=after_tp,
                          command="kto", init_state=start)  # fmt: skip
        before = _demo_accuracy(trainer, objective, cfg) if start is not None else None
        summary = trainer.run()
        if before is not None:
            after = _demo_accuracy(trainer, objective, cfg)
            summary.update({f"{k}_before": v for k, v in before.items()})
            summary.update({f"{k}_after": v for k, v in after.items()})
            logger.info("held-out implicit-reward accuracy on the demo pairs: %.2f before, %.2f after KTO "
                        "(the policy prefers the right answer: %.2f before, %.2f after)",
                        before["reward_accuracy"], after["reward_accuracy"],
                        before["policy_preference"], after["policy_preference"])  # fmt: skip
        return summary


def _demo_accuracy(trainer, objective, cfg):
    """DPO's held-out pair accuracies (one process), with KTO's β."""
    from mindspeed_align.dpo import _demo_accuracy as pair_accuracy

    return pair_accuracy(trainer, objective, SimpleNamespace(dpo=cfg.kto, data=cfg.data))


command = config_command(
    "kto",
    KTOConfig,
    kto,
    help="KTO on unpaired desirable/undesirable examples (no arguments: the embedded demo)",
    demo="SFT then KTO of a debug Llama on the embedded counting task (CPU, a few minutes).",
)
main = command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
