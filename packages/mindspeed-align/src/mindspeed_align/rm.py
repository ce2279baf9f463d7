"""`mindspeed rm` / `python -m mindspeed_align.rm`: train a reward model on preference pairs.

Every section but `rm` is `mindspeed dpo`'s and `mindspeed sft`'s (`data.paths` are the same
pair files; `train.micro_batch`/`global_batch` count pairs). The model is the decoder with a
one-output head (`reward.add_score_head`), the loss Bradley-Terry (`reward.RewardObjective`).
`rm.export_hf` writes a Hugging Face `*ForSequenceClassification` folder at the end.

With no arguments it fine-tunes the debug Llama on the SFT demo (DPO's warm start), trains the
reward model on the demo's preference pairs (chosen: the right answer; rejected: a wrong one)
and prints its held-out accuracy (chosen scored above rejected) before and after.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mindspeed_align.common import check_layout, evaluating, warm_start_for_demo
from mindspeed_align.reward import (
    RewardObjective,
    add_score_head,
    export_classifier,
    full_state_dict,
)
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import is_rank0, process_group
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_llm.data.collate import forward_packed
from mindspeed_llm.train.config import LoggingSection, TrainSection
from mindspeed_llm.train.sft_config import SFTConfig

__all__ = ["RMConfig", "RewardSection", "command", "rm"]

logger = logging.getLogger("mindspeed.rm")


@dataclass(kw_only=True)
class RewardSection:
    center_rewards_coefficient: float = 0.0
    """c of the centring term c·(r_chosen + r_rejected)² added to each pair's loss (TRL's name;
    0: off; TRL recommends 0.01)."""
    export_hf: Path | None = None
    """Write the trained model here at the end as a Hugging Face *ForSequenceClassification
    folder (None: only the run's checkpoints)."""

    def __post_init__(self):
        if self.center_rewards_coefficient < 0:
            raise ConfigError(
                f"rm.center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0"
            )


def _rm_train() -> TrainSection:
    return TrainSection(steps=300, micro_batch=8, global_batch=16, eval_interval=0)


@dataclass(kw_only=True)
class RMConfig(SFTConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=10))
    train: TrainSection = field(default_factory=_rm_train)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir=Path("runs/rm")))
    rm: RewardSection = field(default_factory=RewardSection)
    """The reward model's loss and export."""

    def __post_init__(self):
        super().__post_init__()
        check_layout(self, "rm")
        self.parallel.loss_parallel = False  # a one-output head has no vocabulary to shard


def rm(cfg: RMConfig) -> dict[str, float]:
    """Train a reward model in this process (one rank of a torchrun job, or alone)."""
    from mindspeed_align.pairs import PairData
    from mindspeed_llm.train.trainer import Trainer

    with process_group(cfg.train.device) as info:
        start = warm_start_for_demo(cfg, info)
        objective = RewardObjective(pad_id=0, center_coefficient=cfg.rm.center_rewards_coefficient)
        trainer = Trainer(
            cfg, info, data=PairData, objective=objective, before_tp=add_score_head, command="rm"
        )
        if start is not None:
            trainer.model.load_state_dict(
                {k: v for k, v in start.items() if k != "output.weight"}, strict=False
            )
        before = _demo_accuracy(trainer, cfg) if start is not None else None
        summary = trainer.run()
        if before is not None:
            summary.update(accuracy_before=before, accuracy_after=_demo_accuracy(trainer, cfg))
            logger.info("held-out reward-model accuracy: %.2f before, %.2f after",
                        summary["accuracy_before"], summary["accuracy_after"])  # fmt: skip
        if cfg.rm.export_hf is not None:
            export_trained(trainer, cfg.data, cfg.model, cfg.rm.export_hf)
        return summary


def export_trained(trainer, data, model, out: Path, *, task: str = "sequence") -> None:
    """Write the trained classifier to `out` as a Hugging Face folder (`reward.export_classifier`;
    every rank gathers the shards, rank 0 writes)."""
    state = full_state_dict(trainer.model)
    if is_rank0():
        tokenizer = data.tokenizer or model.hf_path
        written = export_classifier(state, trainer.model_cfg, out, pad_token_id=trainer.data.pad_id,
                                    tokenizer=tokenizer, task=task)  # fmt: skip
        logger.info("exported %s (Hugging Face *For%sClassification)", written, task.capitalize())


@torch.no_grad()
def score_pairs(model, batches, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of packed pair batches (`logps.pack_pairs`)."""
    from mindspeed_align.logps import SLOT_KEY
    from mindspeed_align.reward import sequence_scores

    chosen, rejected = [], []
    for batch in batches:
        slots = batch[SLOT_KEY].masked_fill(batch["input_ids"] == pad_id, -1)
        out = forward_packed(model, batch)
        scores = sequence_scores(out, slots, int(batch[SLOT_KEY].max()) + 1)
        chosen.append(scores[0::2])
        rejected.append(scores[1::2])
    return torch.cat(chosen), torch.cat(rejected)


def _demo_accuracy(trainer, cfg) -> float | None:
    """Held-out accuracy of the demo (one process): chosen scored above rejected."""
    import json

    from mindspeed_align.dpo_demo import ensure_dpo_demo
    from mindspeed_align.logps import pack_pairs
    from mindspeed_align.pairs import encode_pair

    if trainer.dims.world_size > 1:
        return None
    data = trainer.data
    lines = ensure_dpo_demo().heldout.read_text().splitlines()
    pairs = [
        encode_pair(data.template, data.tokenizer, json.loads(line), f"heldout:{i}")
        for i, line in enumerate(lines)
    ]
    batches = [
        pack_pairs(pairs[i : i + 50], cfg.data.seq_len * 8, data.pad_id)
        for i in range(0, len(pairs), 50)
    ]
    with evaluating(trainer.model):
        chosen, rejected = score_pairs(trainer.model, batches, data.pad_id)
    return float((chosen > rejected).float().mean())


command = config_command(
    "rm",
    RMConfig,
    rm,
    help="train a reward model on preference pairs (no arguments: the embedded demo)",
    demo="SFT of a debug Llama, then a reward model on the embedded counting pairs (CPU, a few minutes).",
)
main = command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
