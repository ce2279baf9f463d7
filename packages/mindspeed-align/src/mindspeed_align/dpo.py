"""`mindspeed dpo` / `python -m mindspeed_align.dpo`: preference optimisation of a decoder LLM.

DPO is the shared trainer (`mindspeed_llm.train.Trainer`) with pairs as data
(`pairs.PairData`, both sides of a pair packed in one row) and `PreferenceObjective`: one
policy forward per micro-batch gives every sequence's log-prob (`logps.sequence_logps`), the
frozen reference (`RunContext.starting_policy()`, the same layout and starting weights) gives its
own in `targets`, and the loss is a pure function of them (`losses`). Every section but `data`
and `dpo` is SFT's and pretraining's. metrics.jsonl gets TRL's names: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected.

With no arguments it fine-tunes the debug Llama on the SFT demo for a few steps, then runs DPO on
the demo's preference task and prints the held-out implicit-reward accuracy before and after.
"""

from __future__ import annotations

import logging
import sys

import torch

from mindspeed_align.common import shares_prompts
from mindspeed_align.dpo_config import (
    REFERENCE_FREE,
    DPOConfig,
    DPOSection,
    ORPOConfig,
    SimPOConfig,
)
from mindspeed_align.logps import (
    SLOT_KEY,
    count_pairs,
    frozen_sequence_logps,
    renumber_slots,
    sequence_logps,
    slot_count_tensor,
)
from mindspeed_align.losses import dpo_loss, orpo_loss, simpo_loss
from mindspeed_align.reference import REF_KEY
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_llm.data.collate import IGNORE_INDEX, to_device
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective, RunContext
from mindspeed_ops.validate import host_values

__all__ = ["PreferenceObjective", "command", "dpo", "orpo_command", "simpo_command"]

logger = logging.getLogger("mindspeed.dpo")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")  # fmt: skip


class PreferenceObjective(Objective):
    """Pairs are the units; the loss of a micro-batch is the sum of its pairs' losses.

    Args:
        section: the method (`dpo` config section).
        reference: a frozen reference model to use as it is (tests); by default `setup`
            builds the one `section.ref` names (see `DPOSection.ref`).
        reference_ctx: how the reference's logits are read (its `BuiltModel.loss`).
        reference_after_tp: the model hook the reference is built with (the run's `after_tp`
            without LoRA).
        lora: the policy carries LoRA adapters (its base is a reference for free).
        keep_reference: `dpo.ref: auto` keeps its reference model even when precomputing
            would pay (the demo scores held-out pairs with it after training).
    """

    metric_names = METRICS
    supervised_logits_only = True  # log-probs are sums over the replies' tokens alone
    reads_token_nll_only = True  # the policy's log-probs may come from the fused op

    def __init__(self, section: DPOSection, reference=None, reference_ctx: LossContext | None = None, *,
                 reference_after_tp=None, lora: bool = False, keep_reference: bool = False):  # fmt: skip
        self.section, self.reference, self.reference_ctx = section, reference, reference_ctx
        self.reference_after_tp, self.lora = reference_after_tp, lora
        self.keep_reference = keep_reference
        self.cp_group, self.cp_size = None, 1
        self.reference_keep = False  # the reference projects the replies' positions alone
        self.fused_reference = False  # its log-probs from the fused linear + cross entropy

    def setup(self, run: RunContext) -> None:
        """Context parallel's group, then the reference of `section.ref`: the policy with its
        adapters off (LoRA), a frozen copy, or none left once its log-probs are precomputed
        (always under pipeline or context parallel: the whole model scores every pair once)."""
        if run.dims.cp > 1:
            self.cp_group, self.cp_size = run.dims.mesh("cp").get_group(), run.dims.cp
        run.data.share_prompts = shares_prompts(self.section.shared_prompts, run, "dpo")
        from mindspeed_llm.train.step import supervised_positions_layout

        self.reference_keep = supervised_positions_layout(run.policy, run.dims)
        # a frozen forward has no backward to recompute for: fused unless turned off
        self.fused_reference = self.reference_keep and run.cfg.train.fused_linear_cross_entropy != "off"
        if not self.section.uses_reference or self.reference is not None:
            return
        from mindspeed_align.reference import AdaptersOff, precompute_reference
        from mindspeed_llm.demo import cache_root

        whole = run.dims.pp > 1 or run.dims.cp > 1
        precompute = self.section.ref == "precompute" or whole or (
            self.section.ref == "auto" and not self.keep_reference and _reads_every_pair(run)
        )
        if whole:
            self.reference, self.reference_ctx = _whole_reference(run)
        elif self.lora and self.section.ref in ("auto", "precompute"):
            self.reference, self.reference_ctx = AdaptersOff(run.policy.model), run.policy.loss
        else:
            reference = run.starting_policy(after_tp=self.reference_after_tp)
            self.reference, self.reference_ctx = reference.model, reference.loss
        if precompute:
            precompute_reference(run.data, self.reference, self.reference_ctx, device=run.device,
                                 micro_pairs=run.cfg.train.micro_batch, fused=self.fused_reference,
                                 cache_dir=run.cfg.data.cache_dir or cache_root() / "dpo")  # fmt: skip
            self.reference = None  # the pairs carry their log-probs; the copy can go

    def num_units(self, batch):
        return count_pairs(batch[SLOT_KEY])

    def targets(self, batch):
        """From the step's host batch (its values read for free): the slots renumbered, their
        count, and the reference's log-probs (its forward on the device)."""
        slots = renumber_slots(batch[SLOT_KEY])
        # num_slots whole: a context-parallel rank may hold none of a short sequence's tokens
        targets = {"labels": batch["labels"], SLOT_KEY: slots,
                   "num_slots": slot_count_tensor(int(slots.max()) + 1)}  # fmt: skip
        num_slots = host_values(targets["num_slots"])
        if REF_KEY in batch:  # dpo.ref: precompute: each sequence's value on its first token
            keep = slots >= 0
            ref = torch.zeros(num_slots, dtype=torch.float32, device=slots.device)
            targets["ref_logps"] = ref.index_add(0, slots[keep], batch[REF_KEY][keep].float())
        elif self.reference is not None:
            device = next(self.reference.parameters()).device
            # the output layer on the replies' positions only, or fused (no logits)
            keep = None
            if self.reference_keep:  # flat positions, found on the host
                keep = (batch["labels"] != IGNORE_INDEX).flatten().nonzero().squeeze(1)
                keep = keep.to(device, non_blocking=True)
            moved = to_device({**batch, SLOT_KEY: slots}, device)  # the host copies stay
            targets["ref_logps"] = frozen_sequence_logps(
                self.reference, moved, moved[SLOT_KEY], num_slots, self.reference_ctx, keep=keep,
                fused=self.fused_reference,
            )  # fmt: skip
        elif self.section.uses_reference:
            raise RuntimeError("PreferenceObjective: set .reference before the first step")
        return targets

    def loss(self, outputs, targets, ctx: LossContext) -> LossOutput:
        num_slots = host_values(targets["num_slots"])
        logps, counts = sequence_logps(outputs, targets["labels"], targets[SLOT_KEY], num_slots, ctx)
        if self.cp_group is not None:  # each cp rank holds a share of every sequence's tokens
            logps, counts = _sum_over(self.cp_group, logps, counts)
        chosen, rejected = logps[0::2], logps[1::2]
        chosen_len, rejected_len = counts[0::2].clamp(min=1), counts[1::2].clamp(min=1)
        out = self._method(chosen, rejected, chosen_len, rejected_len, targets.get("ref_logps"))
        nll_weight = self.section.pref_ftx + (1.0 if self.section.loss == "orpo" else 0.0)
        losses = out.losses - nll_weight * chosen / chosen_len
        margins = out.chosen_rewards - out.rejected_rewards
        values = (out.chosen_rewards, out.rejected_rewards, margins, (margins > 0).float(), chosen, rejected)
        share = 1.0 / self.cp_size  # every cp rank has the whole loss; the step sums over them
        return LossOutput(losses.sum() * share,
                          {k: v.detach().sum() * share for k, v in zip(METRICS, values, strict=True)})  # fmt: skip

    def _method(self, chosen, rejected, chosen_len, rejected_len, ref):
        s = self.section
        if s.loss == "simpo":
            return simpo_loss(chosen / chosen_len, rejected / rejected_len, beta=s.beta, gamma=s.simpo_gamma,
                              label_smoothing=s.label_smoothing)  # fmt: skip
        if s.loss == "orpo":
            return orpo_loss(chosen / chosen_len, rejected / rejected_len, beta=s.beta)
        return dpo_loss(chosen, rejected, ref[0::2], ref[1::2], beta=s.beta, loss=s.loss,
                        label_smoothing=s.label_smoothing, chosen_lengths=chosen_len,
                        rejected_lengths=rejected_len)  # fmt: skip


def _sum_over(group, logps, counts):
    """Per-slot sums over the ranks of `group`: log-probs with their gradient (each rank's
    share gets the whole sum's), counts without."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return all_reduce(logps, group=group), counts


def dpo(cfg: DPOConfig, *, before_tp=None, after_tp=None) -> dict[str, float]:
    """Run DPO in this process (one rank of a torchrun job, or alone)."""

    from mindspeed_align.pairs import PairData
    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.sft import chain_hooks
    from mindspeed_llm.train.trainer import Trainer

    demo = not cfg.data.paths
    with process_group(cfg.train.device) as info:
        start = None
        if demo:
            from mindspeed_align.dpo_demo import warm_start

            start = warm_start(cfg, info)
        lora = lora_trainer_options(
            cfg.lora, precision=cfg.train.precision, device_type=info.device.type
        )
        objective = PreferenceObjective(cfg.dpo, reference_after_tp=after_tp, lora=bool(lora),
                                        keep_reference=demo)  # fmt: skip
        name = cfg.dpo.loss if cfg.dpo.loss in REFERENCE_FREE else "dpo"
        trainer = Trainer(cfg, info, data=PairData, objective=objective, before_tp=before_tp,
                          after_tp=chain_hooks(after_tp, lora.pop("after_tp", None)), command=name,
                          init_state=start, **lora)  # fmt: skip
        before = _demo_accuracy(trainer, objective, cfg) if demo else None
        summary = trainer.run()
        if before is not None:
            after = _demo_accuracy(trainer, objective, cfg)
            summary.update({f"{k}_before": v for k, v in before.items()})
            summary.update({f"{k}_after": v for k, v in after.items()})
            logger.info("held-out implicit-reward accuracy: %.2f before, %.2f after %s; mean reward "
                        "margin %.3f before, %.3f after (the policy prefers the right answer: %.2f "
                        "before, %.2f after)", before["reward_accuracy"], after["reward_accuracy"], name.upper(),
                        before["reward_margin"], after["reward_margin"],
                        before["policy_preference"], after["policy_preference"])  # fmt: skip
        return summary


def _reads_every_pair(run) -> bool:
    """`dpo.ref: auto`: precompute when the run's steps read every training pair at least
    once: one pass of the reference over the data then costs no more forwards than scoring
    each step's pairs, and the frozen copy's memory is freed before step 1."""
    pairs = len(run.data.train)
    reads = run.cfg.train.steps * run.cfg.train.global_batch
    choice = reads >= pairs
    logger.info("dpo.ref=auto: %s (%d steps x %d pairs read %d of %d training pairs)",
                "precomputing the reference log-probs" if choice else "a reference model",
                run.cfg.train.steps, run.cfg.train.global_batch, reads, pairs)  # fmt: skip
    return choice


def _whole_reference(run: RunContext):
    """The starting model whole and unsplit in this process (pipeline and context parallel
    runs precompute the reference log-probs with it; a pipeline stage cannot score a pair
    alone)."""
    model = run.starting_policy(whole=True)
    return model, LossContext(ops_impl=run.model_config.ops_impl)


def _demo_accuracy(trainer, objective, cfg) -> dict[str, float] | None:
    """Held-out accuracies of the demo (one process, with a reference)."""
    import json

    from mindspeed_align.dpo_demo import ensure_dpo_demo, reward_accuracy
    from mindspeed_align.logps import pack_pairs
    from mindspeed_align.pairs import encode_pair

    if trainer.dims.world_size > 1 or (objective.reference is None and objective.section.uses_reference):
        return None  # several processes, or a precomputed reference (gone by now)
    data = trainer.data
    lines = ensure_dpo_demo().heldout.read_text().splitlines()
    pairs = [encode_pair(data.template, data.tokenizer, json.loads(line), f"heldout:{i}") for i, line in enumerate(lines)]
    batches = [pack_pairs(pairs[i : i + 50], cfg.data.seq_len * 8, data.pad_id) for i in range(0, len(pairs), 50)]
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        return reward_accuracy(trainer.model, objective.reference, trainer.parts.model.loss, batches, cfg.dpo.beta)
    finally:
        trainer.model.train(was_training)


command = config_command(
    "dpo",
    DPOConfig,
    dpo,
    help="direct preference optimisation (no arguments: the embedded demo)",
    demo="SFT then DPO of a debug Llama on the embedded counting task (CPU, a few minutes).",
)
main = command.run
simpo_command = config_command(
    "simpo",
    SimPOConfig,
    dpo,
    help="SimPO: reference-free preference optimisation (`mindspeed dpo` with dpo.loss=simpo)",
    demo="SFT then SimPO of a debug Llama on the embedded counting task (CPU, a few minutes).",
)
orpo_command = config_command(
    "orpo",
    ORPOConfig,
    dpo,
    help="ORPO: odds-ratio preference optimisation (`mindspeed dpo` with dpo.loss=orpo)",
    demo="SFT then ORPO of a debug Llama on the embedded counting task (CPU, a few minutes).",
)


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(guarded(main, [a for a in args if a != "--debug"], debug=debug_enabled(args)))

