"""`mindspeed pretrain` / `python -m mindspeed_llm.pretrain`: pretrain a decoder LLM.

Pretraining is the shared trainer (`mindspeed_llm.train`) with the GPT data of Megatron
indexed datasets (`train.pretrain_data`) and the next-token objective.

With no arguments it trains the `debug` Llama on the embedded demo corpus on CPU.
Several processes: `torchrun --standalone --nproc-per-node 2 -m mindspeed_llm.pretrain
--parallel.tp 2`.
"""

from __future__ import annotations

import logging
import sys

from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_llm.train.config import PretrainConfig

logger = logging.getLogger("mindspeed.pretrain")


def pretrain(cfg: PretrainConfig) -> dict[str, float]:
    """Run pretraining in this process (one rank of a torchrun job, or alone)."""

    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.pretrain_data import PretrainData
    from mindspeed_llm.train.trainer import Trainer

    with process_group(cfg.train.device) as info:
        objective = NextToken(cfg.train.loss_normalization)
        summary = Trainer(cfg, info, data=PretrainData, objective=objective).run()
        if summary["first_loss"] is None:
            logger.info(
                "nothing to do: the checkpoint is already at step %d of %d; raise "
                "--train.steps to train on",
                summary["steps"],
                cfg.train.steps,
            )
        else:
            speed = ", ".join(
                f"{rate:,.0f} over steps {window}"
                for window, rate in summary.get("tokens_per_s", {}).items()
            )
            logger.info(
                "trained to step %d: loss %.3f -> %.3f; tokens/s %s; start-up peak per rank "
                "%s GiB; peak memory per rank %s GiB; optimizer state per rank %s MiB; run "
                "directory %s",
                summary["steps"],
                summary["first_loss"],
                summary["final_loss"],
                speed or "not measured",
                ", ".join(f"{peak:.2f}" for peak in summary["startup_peak_gb_per_rank"]),
                ", ".join(f"{peak:.2f}" for peak in summary["peak_gb_per_rank"]),
                ", ".join(f"{gb * 1024:.2f}" for gb in summary["optimizer_state_gb_per_rank"]),
                cfg.logging.run_dir,
            )
        return summary


command = config_command(
    "pretrain",
    PretrainConfig,
    pretrain,
    help="pretrain a decoder LLM (no arguments: the embedded demo)",
    demo="the debug Llama on the embedded demo corpus (CPU, a few minutes).",
)
main = command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
