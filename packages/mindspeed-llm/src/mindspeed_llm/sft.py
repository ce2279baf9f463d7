"""`mindspeed sft` / `python -m mindspeed_llm.sft`: supervised fine-tuning of a decoder LLM.

SFT is the shared trainer (`mindspeed_llm.train`) with instruction data
(`train.sft_data`: raw alpaca / sharegpt / messages files or preprocess outputs, a chat
template, only assistant tokens supervised, padded or packed) and the next-token
objective. Every section but `data` is pretraining's, with the same spellings.

With no arguments it trains a debug Llama on the embedded counting task and prints the
held-out exact match before and after. Several processes: `torchrun --standalone
--nproc-per-node 2 -m mindspeed_llm.sft --parallel.tp 2`.
"""

from __future__ import annotations

import json
import logging
import sys

from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_llm.models.common.parallelize import ModelHook
from mindspeed_llm.train.sft_config import SFTConfig

logger = logging.getLogger("mindspeed.sft")


def sft(
    cfg: SFTConfig, *, before_tp: ModelHook | None = None, after_tp: ModelHook | None = None
) -> dict[str, float]:
    """Run SFT in this process (one rank of a torchrun job, or alone). `after_tp` /
    `before_tp` reach `build_model` (adapters such as LoRA go in `after_tp`)."""

    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.sft_data import SFTData
    from mindspeed_llm.train.trainer import Trainer

    demo = not cfg.data.paths
    with process_group(cfg.train.device) as info:
        lora = lora_trainer_options(cfg.lora, precision=cfg.train.precision,
                                    device_type=info.device.type)  # fmt: skip
        after_tp = chain_hooks(after_tp, lora.pop("after_tp", None))
        # the loss reads the replies' logits only: the prompts' are never projected
        objective = NextToken(cfg.train.loss_normalization, supervised_logits_only=True)
        trainer = Trainer(cfg, info, data=SFTData, objective=objective,
                          before_tp=before_tp, after_tp=after_tp, command="sft", **lora)  # fmt: skip
        before = _demo_accuracy(trainer) if demo else None
        summary = trainer.run()
        if before is not None:
            after = _demo_accuracy(trainer)
            summary.update(exact_match_before=before, exact_match_after=after)
            logger.info("held-out exact match: %.0f%% before, %.0f%% after fine-tuning",
                        100 * before, 100 * after)  # fmt: skip
        if summary["first_loss"] is not None:
            logger.info("trained to step %d: loss %.3f -> %.3f; run directory %s",
                        summary["steps"], summary["first_loss"], summary["final_loss"],
                        cfg.logging.run_dir)  # fmt: skip
        return summary


def chain_hooks(first: ModelHook | None, second: ModelHook | None) -> ModelHook | None:
    """One hook running `first` then `second` (the caller's, then LoRA's)."""
    if first is None or second is None:
        return first or second

    def both(model, dims) -> None:
        first(model, dims)
        second(model, dims)

    return both


def _demo_accuracy(trainer) -> float | None:
    """Exact match on the demo's held-out questions (one process only)."""
    from mindspeed_llm.sft_demo import ensure_sft_demo, exact_match

    if trainer.dims.world_size > 1:
        return None
    records = [json.loads(line) for line in ensure_sft_demo().heldout.read_text().splitlines()]
    return exact_match(trainer.model, trainer.data.tokenizer, trainer.data.template, records)


command = config_command(
    "sft",
    SFTConfig,
    sft,
    help="supervised fine-tuning (no arguments: the embedded demo)",
    demo="a debug Llama on the embedded counting task (CPU, a few minutes).",
)
main = command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
