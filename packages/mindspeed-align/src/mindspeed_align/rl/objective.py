"""GRPO's training batches and objective on the shared engine (`mindspeed_llm.train`).

A rollout's samples (prompt + response) are packed into rows with `cu_seqlens`, labels
on the response tokens only. Per token ride along: the advantage, the recomputed old
log-prob, the reference log-prob (KL), the aggregation weight and `unit` (1 where a unit
of the aggregation starts: every response token for token-mean, the first response token
of each sample for the sequence means), so the engine's "sum of units' losses / units of
the whole step" is exactly `losses.aggregate` over every micro-batch and rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from mindspeed_align.rl.losses import POLICY_LOSSES, kl_estimate, truncated_is_weights
from mindspeed_core.parallel import loss_parallel_context
from mindspeed_core.parallel.dtensor import full
from mindspeed_llm.data.collate import IGNORE_INDEX, SHARED_KEYS, Batch, forward_packed
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective, token_nll

__all__ = ["GRPOObjective", "Mismatch", "pack_samples", "recompute_logps", "token_logps"]


def token_logps(logits: Tensor, labels: Tensor, ctx: LossContext, temperature: float = 1.0):
    """(tokens,) log softmax(logits / T) of the labels, 0 where labels are -100 (at T = 1
    no scaled copy of the logits is made: one (tokens x vocab) tensor less at the peak)."""
    scaled = logits if temperature == 1.0 else logits / temperature
    return -token_nll(scaled, labels, ctx, reduction="none")


def pack_samples(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    per_sample: dict[str, Sequence[float]],
    per_token: dict[str, Sequence[Sequence[float]]],
    *,
    agg: str,
    max_new_tokens: int,
    pad_multiple: int = 8,
    masks: Sequence[Sequence[int]] | None = None,
    share_prompts: bool = False,
) -> Batch:
    """One packed row of samples. `per_sample` values (advantages) are spread over each
    response's tokens; `per_token` values (one per response token) land on the positions
    that predict those tokens. `masks` (per response token, 0 where an environment wrote
    it) leave those tokens unlabelled and unweighted: a sample's length in the aggregation
    is its policy tokens. Padding to a multiple of `pad_multiple` is one more, unsupervised
    document.

    `share_prompts`: consecutive samples of one prompt hold it once: its tokens but the last
    are a document of their own, then each sample is a document of the prompt's last token
    and its response, attending to the shared tokens' keys and its own (the batch's
    `SHARED_KEYS`, the model's `SharedKeys`), positions continuing the prompt's. Every
    per-token value sits where it would without sharing, relative to its response."""
    row = _Row((*per_sample, *per_token, "weights", "metric_weights", "unit"), share_prompts)
    shared_at, shared_prompt = None, None  # where the current shared prompt starts, and it
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p, n = list(p), len(r)
        mask = [1] * n if masks is None else list(masks[i])
        trained = sum(mask)
        skip = 0  # prompt tokens held by the shared document
        if share_prompts and len(p) > 1:
            if p != shared_prompt:  # a new group: its prompt but the last token, once
                shared_prompt = p
                shared_at = row.add(p[:-1], [IGNORE_INDEX] * (len(p) - 1), {})
            skip = len(p) - 1
        else:
            shared_prompt = None
        lead, tail = [0.0] * (len(p) - 1 - skip), [0.0]
        values = {key: lead + [float(v[i])] * n + tail for key, v in per_sample.items()}
        values.update({key: lead + [float(x) for x in v[i]] + tail for key, v in per_token.items()})
        weight, metric = _weights(agg, max(trained, 1), max_new_tokens)
        first = mask.index(1) if trained else -1
        units = [float(m) if agg == "token-mean" else float(t == first) for t, m in enumerate(mask)]
        values.update(weights=lead + [weight * m for m in mask] + tail,
                      metric_weights=lead + [metric * m for m in mask] + tail, unit=lead + units + tail)  # fmt: skip
        labelled = [t if m else IGNORE_INDEX for t, m in zip(r, mask, strict=True)]
        row.add(p[skip:] + list(r), [IGNORE_INDEX] * (len(p) - 1 - skip) + labelled + [IGNORE_INDEX],
                values, first=skip, prefix=shared_at if skip else None)  # fmt: skip
    pad = -len(row.ids) % pad_multiple or (0 if row.ids else pad_multiple)  # never an empty row
    if pad:
        row.add([0] * pad, [IGNORE_INDEX] * pad, {})
    return row.batch()


class _Row:
    """A packed row as `pack_samples` builds it: its documents' tokens, labels, positions,
    per-token values, and with shared prompts each document's keys."""

    def __init__(self, value_keys, shared: bool):
        self.ids, self.labels, self.positions, self.bounds = [], [], [], [0]
        self.values = {k: [] for k in value_keys}
        self.shared, self.keys, self.key_bounds, self.offsets = shared, [], [0], []

    def add(self, ids, labels, values: dict[str, list], *, first: int = 0, prefix=None) -> int:
        """One document (its values per key, 0 for a key left out) at positions from `first`;
        `prefix`: where the shared document its keys begin with starts (`first` tokens long).
        Returns where the document starts."""
        start = len(self.ids)
        self.ids += ids
        self.labels += labels
        self.positions += range(first, first + len(ids))
        self.bounds.append(len(self.ids))
        for key, column in self.values.items():
            column += values.get(key, [0.0] * len(ids))
        if self.shared:
            shared = range(prefix, prefix + first) if prefix is not None else ()
            self.keys += [*shared, *range(start, len(self.ids))]
            self.key_bounds.append(len(self.keys))
            self.offsets.append(first if prefix is not None else 0)
        return start

    def batch(self) -> Batch:
        batch = {
            "input_ids": torch.tensor([self.ids]),
            "labels": torch.tensor([self.labels]),
            "position_ids": torch.tensor([self.positions]),
            "cu_seqlens": torch.tensor(self.bounds, dtype=torch.int32),
        }
        batch.update({k: torch.tensor([v], dtype=torch.float32) for k, v in self.values.items()})
        if self.shared:
            batch.update(zip(SHARED_KEYS, (torch.tensor(self.keys, dtype=torch.long),
                                           torch.tensor(self.key_bounds, dtype=torch.int32),
                                           torch.tensor(self.offsets, dtype=torch.long)), strict=True))  # fmt: skip
        return batch


def _weights(agg: str, n: int, max_new_tokens: int) -> tuple[float, float]:
    """(loss weight, metric weight) of each of a response's n tokens."""
    if agg == "token-mean":
        return 1.0, 1.0
    if agg == "seq-mean-token-mean":
        return 1.0 / n, 1.0 / n
    if agg == "seq-mean-token-sum":
        return 1.0, 1.0 / n
    if agg == "seq-mean-token-sum-norm":
        return 1.0 / max_new_tokens, 1.0 / n
    raise ValueError(f"loss aggregation {agg!r} is unknown")


class Mismatch:
    """The rollout/trainer mismatch verl and OpenRLHF users watch for, over the response
    tokens: |trainer log-prob - sampler log-prob| (sum, count, max), the k3 estimate of
    KL(sampler || trainer) (sum), and with a TIS `cap` the tokens whose weight it caps."""

    def __init__(self, cap: float | None = None):
        self.sum, self.count, self.max, self.kl_sum, self.capped = 0.0, 0, 0.0, 0.0, 0
        self.cap = cap

    def add(self, logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> None:
        log_ratio = (logps.detach().float() - sampler_logps)[mask]
        if log_ratio.numel():
            diff = log_ratio.abs()
            self.sum, self.count = self.sum + diff.sum().item(), self.count + diff.numel()
            self.max = max(self.max, diff.max().item())
            # k3 of KL(sampler || trainer), in float64: >= 0 even where the two barely differ
            kl = kl_estimate(sampler_logps[mask].double(), logps.detach().double()[mask])
            self.kl_sum += kl.sum().item()
            if self.cap is not None:
                self.capped += int((log_ratio.exp() > self.cap).sum())


class GRPOObjective(Objective):
    """A registered policy loss (`losses.POLICY_LOSSES`, PPO's clipped surrogate by
    default) + kl_coef * KL(policy || reference), aggregated by the batch's weights.
    Metrics (means over the aggregation's units): kl, clip fraction, entropy, ratio.

    The ratio's old log-probs are the batch's "old_logps" when it has them (recomputed
    before the step); else the training forward's own, detached (one update per rollout:
    the same numbers, one forward fewer). With "sampler_logps" in the batch and a
    `mismatch` set, the forward's log-probs are compared with the sampler's there; with a
    `rollout_correction_cap` the policy loss is multiplied by `losses.truncated_is_weights`
    of the old and the sampler's log-probs.

    Args:
        loss: the policy loss's registered name.
        eps_low / eps_high / dual_clip: its clip range (see `losses.policy_loss`).
        kl_coef / kl_estimator: the KL penalty in the loss (0: no reference needed).
        temperature: the sampling temperature; log-probs are of softmax(logits / T).
        rollout_correction_cap: TIS's cap; None: no correction.
    """

    metric_names = ("kl", "clip_fraction", "entropy", "ratio")
    supervised_logits_only = True  # every target is per response token

    def __init__(self, *, loss="ppo_clip", eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0,
                 kl_estimator="k3", temperature=1.0, rollout_correction_cap=None):  # fmt: skip
        self.policy_loss = POLICY_LOSSES[loss]
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip
        self.kl_coef, self.kl_estimator, self.temperature = kl_coef, kl_estimator, temperature
        self.rollout_correction_cap = rollout_correction_cap
        self.mismatch: Mismatch | None = None

    @classmethod
    def from_section(cls, rl) -> GRPOObjective:
        """The loss `rl` (a `config.GRPOSection`) asks for: its policy loss with the clip
        range and TIS cap it gives (the loss's own where unset), and the KL in the loss
        unless it goes into the reward (PPO's kl_in_reward)."""
        low, high = rl.clip_range()
        kl_in_loss = 0.0 if getattr(rl, "kl_in_reward", False) else rl.kl_coef
        return cls(loss=rl.loss, eps_low=low, eps_high=high, dual_clip=rl.dual_clip,
                   kl_coef=kl_in_loss, kl_estimator=rl.kl_estimator, temperature=rl.temperature,
                   rollout_correction_cap=rl.rollout_correction_cap)  # fmt: skip

    def watch(self, mismatch: Mismatch | None) -> None:
        """Compare the next forwards' log-probs with the sampler's into `mismatch` (None:
        do not; the step measured them by recomputing the old log-probs)."""
        self.mismatch = mismatch

    def num_units(self, batch: Batch) -> Tensor:
        return batch["unit"].sum()

    def targets(self, batch: Batch) -> dict[str, Tensor]:
        keys = ["labels", "weights", "metric_weights", "advantages"]
        keys += [k for k in ("old_logps", "sampler_logps") if k in batch]
        if self.kl_coef:
            keys.append("ref_logps")
        out = {k: batch[k] for k in keys}
        if self.policy_loss.sequence:  # each position's document: one sample's response
            sizes = batch["cu_seqlens"].diff().long()
            sequences = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
            out["sequences"] = sequences.view_as(batch["labels"])
        return out

    def loss(self, outputs: Tensor, targets: dict[str, Tensor], ctx: LossContext) -> LossOutput:
        labels = targets["labels"].flatten()
        logp = token_logps(outputs, labels, ctx, self.temperature)
        old = targets["old_logps"].flatten() if "old_logps" in targets else logp.detach()
        sampler = targets["sampler_logps"].flatten() if "sampler_logps" in targets else None
        if self.mismatch is not None and sampler is not None:
            self.mismatch.add(logp, sampler, labels != IGNORE_INDEX)
        adv = targets["advantages"].flatten()
        sequences = targets["sequences"].flatten() if "sequences" in targets else None
        pg, clipped = self.policy_loss.fn(logp, old, adv, mask=labels != IGNORE_INDEX,
                                          sequences=sequences, eps_low=self.eps_low,
                                          eps_high=self.eps_high, dual_clip=self.dual_clip)  # fmt: skip
        if self.rollout_correction_cap is not None and sampler is not None:
            pg = pg * truncated_is_weights(old, sampler, self.rollout_correction_cap)
        per_token = pg
        weights, metric = targets["weights"].flatten(), targets["metric_weights"].flatten()
        with torch.no_grad():
            kl = torch.zeros_like(logp)
            entropy = _entropy(outputs, self.temperature).flatten()
        if self.kl_coef:
            kl_t = kl_estimate(logp, targets["ref_logps"].flatten(), self.kl_estimator)
            per_token = per_token + self.kl_coef * kl_t
            kl = kl_t.detach()
        metrics = {
            "kl": (kl * metric).sum(),
            "clip_fraction": (clipped * metric).sum(),
            "entropy": (entropy * metric).sum(),
            "ratio": (torch.exp(logp.detach() - old) * metric).sum(),
        }
        return LossOutput((per_token * weights).sum(), metrics)


def _entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy of softmax(logits / T) at every position (no gradient)."""
    logps = torch.log_softmax(full(logits).float() / temperature, dim=-1)
    return -(logps.exp() * logps).sum(-1)


@torch.no_grad()
def recompute_logps(model, batch: Batch, temperature: float = 1.0, *,
                    supervised_only: bool = False) -> Tensor:  # fmt: skip
    """Teacher-forced log-probs of `batch`'s labels under `model` (a `BuiltModel`), shaped
    like input_ids (0 where unsupervised): the loss's old log-probs, or the reference's.
    `supervised_only` (a layout where `supervised_positions_layout` holds): the output
    layer runs on the response positions alone, not on every prompt token too."""
    b = {k: v.to(model.device) for k, v in batch.items()}
    labels = b["labels"]
    extra = {"keep": labels != IGNORE_INDEX} if supervised_only else {}
    with contextlib.ExitStack() as stack:
        if model.autocast is not None:
            stack.enter_context(torch.autocast(model.device.type, dtype=model.autocast))
        stack.enter_context(loss_parallel_context(model.loss.loss_parallel))
        logits = forward_packed(model.model, b, **extra)
        if not supervised_only:
            return token_logps(logits, labels, model.loss, temperature).float().view_as(labels).cpu()
        kept = token_logps(logits, labels[extra["keep"]], model.loss, temperature)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=kept.device)
    out[extra["keep"]] = kept.float()
    return out.cpu()
