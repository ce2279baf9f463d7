"""A method written from outside the packages, on public names only: SFT regularised by the
KL divergence from the starting model (the frozen reference keeps the policy near where it
began; InstructGPT's "SFT + KL", TRL's `beta` in its online trainers).

    loss = sum over supervised tokens of [nll + beta * k3(policy, reference)] / their number

k3 is the unbiased, always non-negative KL estimate exp(r) - r - 1 with r = ref - policy
log-prob of the label (as GRPO uses it). `Objective.setup` builds the reference: the run's
model config, layout, seed and starting weights, frozen. The trainer does the rest (packing,
accumulation, every parallel layout but pipeline parallel, checkpoints, exact resume; under
`--parallel.pp` the reference is refused in one line: it runs inside each step, and a
pipeline stage holds only its own layers).

    python examples/kl_sft.py --train.steps 40    # any `mindspeed sft` option; no data: the demo
"""

import sys

import torch

from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.distributed import process_group
from mindspeed_llm.data.collate import forward_packed
from mindspeed_llm.train.objectives import LossOutput, NextToken, RunContext, token_nll
from mindspeed_llm.train.sft_config import SFTConfig
from mindspeed_llm.train.sft_data import SFTData
from mindspeed_llm.train.trainer import Trainer


class KLRegularisedSFT(NextToken):
    """Next-token cross entropy + beta * KL(policy || reference) per supervised token."""

    metric_names = ("nll", "kl")

    def __init__(self, beta: float = 0.1):
        super().__init__("token")  # units: supervised tokens
        self.beta, self.reference = beta, None

    def setup(self, run: RunContext) -> None:  # once, when the trainer is built
        self.reference = run.starting_policy()  # the policy as it starts, frozen

    def targets(self, batch):  # per token (sharded with the inputs under context parallel)
        with torch.no_grad():
            logits = forward_packed(self.reference.model, batch)
            nll = token_nll(logits, batch["labels"], self.reference.loss, reduction="none")
        return {"labels": batch["labels"], "ref_logps": -nll.view_as(batch["labels"])}

    def loss(self, outputs, targets, ctx):
        nll = token_nll(outputs, targets["labels"], ctx, reduction="none")
        supervised = targets["labels"].flatten() != -100
        r = (targets["ref_logps"].flatten() + nll).clamp(-20, 20)  # ref - policy log-prob
        kl = (torch.exp(r) - r - 1) * supervised
        total = (nll + self.beta * kl).sum()
        return LossOutput(total, {"nll": nll.detach().sum(), "kl": kl.detach().sum()})


def main(argv: list[str]) -> int:
    cfg = load_config(SFTConfig, None, ["--logging.run_dir=runs/kl-sft", *argv])
    with process_group(cfg.train.device) as info:
        trainer = Trainer(cfg, info, data=SFTData, objective=KLRegularisedSFT(beta=0.1),
                          command="kl-sft")  # fmt: skip
        summary = trainer.run()
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}; {cfg.logging.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, sys.argv[1:]))
