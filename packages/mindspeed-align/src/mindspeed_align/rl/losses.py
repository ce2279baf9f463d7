"""Policy-gradient losses per token, KL estimators and loss aggregation, as pure functions.

Per token, with ratio = exp(logp - old_logp) and advantage A (verl's "vanilla" policy
loss, TRL's GRPO loss):

    pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))   PPO clip
    pg = min(pg, -A * c)  where A < 0                                   dual clip (c > 1)

eps_high > eps_low is DAPO's clip-higher. A KL penalty against a reference adds
kl_coef * k(logp, ref_logp) per token. `aggregate` turns per-token values into the loss
of a batch; the trainer uses `token_weights` (the same rule as weights over tokens) so
that the loss can be summed across micro-batches and ranks.

Policy losses are a registry (`POLICY_LOSSES`, `register_policy_loss`; verl's
`register_policy_loss`): "ppo_clip" (the above, verl's "vanilla"), "gspo" and "cispo";
`grpo.loss` names one. `truncated_is_weights` is the rollout correction (TIS) that
multiplies whichever policy loss by the trainer/sampler ratio, capped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "PolicyLoss", "aggregate", "cispo_loss",
           "gspo_loss", "kl_estimate", "policy_loss", "register_policy_loss", "sequence_means",
           "token_weights", "truncated_is_weights", "value_loss"]  # fmt: skip

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3", *, clamp: float | None = None):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating
    KL divergence"), with log r = ref_logp - logp:

        k1 = -log r = logp - ref_logp                  (unbiased, high variance)
        k2 = (log r)^2 / 2                             (biased, low variance)
        k3 = exp(log r) - log r - 1                    (unbiased, >= 0; verl's low_var_kl,
                                                        TRL's GRPO KL)

    clamp: clip the estimate to [-clamp, clamp] (verl: 10 for k3); None: no clip.
    """
    log_ratio = ref_logp - logp
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.exp(log_ratio) - log_ratio - 1
    else:
        raise ValueError(f"kl estimator {kind!r} is not one of {KL_ESTIMATORS}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate (formula in the module docstring).

    Args:
        logp: log-probs of the sampled tokens under the policy being trained.
        old_logp: the same under the policy that sampled them (detached).
        advantages: per token (an outcome advantage broadcast over its response).
        eps_low / eps_high: the clip range [1 - eps_low, 1 + eps_high].
        dual_clip: c > 1 bounds the loss of negative advantages by -A * c; None: off.

    Returns:
        (loss per token, clipped per token as 0./1.: the clip was active).
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1")
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = torch.maximum(was_clipped, dual.float())
    return loss, was_clipped


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float | None = 0.2
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token (verl's `compute_value_loss`, TRL's PPO):

        loss = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)

    Args:
        values: the critic's new values V.
        old_values: its values when the rollout was scored (detached).
        returns: the targets R (GAE advantages + old values).
        clip: c; None: 0.5 * (V - R)^2 alone.

    Returns:
        (loss per token, clipped per token as 0./1.: the clipped term was the larger).
    """
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def token_weights(mask: Tensor, agg: str, *, max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """(per-token weights, number of units) of an aggregation over (seqs, tokens) values:

        token-mean               sum_t m x / sum_t m             units: the tokens
        seq-mean-token-mean      mean_s (sum_t m x / sum_t m)    units: the sequences
        seq-mean-token-sum       mean_s (sum_t m x)              units: the sequences
        seq-mean-token-sum-norm  mean_s (sum_t m x) / max_len    units: the sequences
                                 (Dr.GRPO: a constant instead of each length)

    so that aggregate(x) = sum(weights * x) / units, and sums of both over micro-batches
    and ranks give the aggregate of the whole step.
    """
    mask = mask.float()
    lengths = mask.sum(-1, keepdim=True)
    seqs = (lengths > 0).sum().float()
    if agg == "token-mean":
        return mask, mask.sum()
    if agg == "seq-mean-token-mean":
        return mask / lengths.clamp(min=1), seqs
    if agg == "seq-mean-token-sum":
        return mask, seqs
    if agg == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the longest response allowed)")
        return mask / max_len, seqs
    raise ValueError(f"loss aggregation {agg!r} is not one of {AGGREGATIONS}")


def aggregate(values: Tensor, mask: Tensor, agg: str = "token-mean", *, max_len=None) -> Tensor:
    """The loss of a batch from per-token `values` (seqs, tokens) and the response mask."""
    weights, units = token_weights(mask, agg, max_len=max_len)
    return (values * weights).sum() / units


# -- the policy-loss registry ---------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[Tensor, Tensor]]
"""A policy loss: (logp, old_logp, advantages, *, mask, sequences, eps_low, eps_high,
dual_clip) -> (loss per token, clipped per token as 0./1.). All tensors have one shape
(the objective's flat packed tokens, or (seqs, tokens) in tests); `mask` is 1 on the
trained tokens; `sequences` (long) gives each token's sequence index, only for a loss
registered with `sequence=True` (else None)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss (`grpo.loss` names it) and the defaults it brings."""

    fn: PolicyLossFn
    clip_low: float
    """The clip range's lower eps where `grpo.clip_low` is left unset."""
    clip_high: float
    """Its upper eps where `grpo.clip_high` is left unset."""
    loss_agg: str = "token-mean"
    """The aggregation where `grpo.loss_agg` is left unset."""
    sequence: bool = False
    """It reads whole responses: the objective passes each token's sequence index."""
    dual_clip: bool = False
    """It takes `grpo.dual_clip`."""


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every policy loss by its config name; `register_policy_loss` adds one."""


def register_policy_loss(name: str, *, clip_low: float = 0.2, clip_high: float = 0.2,
                         loss_agg: str = "token-mean", sequence: bool = False,
                         dual_clip: bool = False):  # fmt: skip
    """Register `fn` (see `PolicyLossFn`) as the policy loss `name`: one decorated function
    makes `--grpo.loss NAME` train with it (verl's `register_policy_loss`)."""
    if loss_agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg={loss_agg!r} is not one of {AGGREGATIONS}")

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered already")
        POLICY_LOSSES[name] = PolicyLoss(fn, clip_low, clip_high, loss_agg, sequence, dual_clip)
        return fn

    return add


def sequence_means(values: Tensor, mask: Tensor, sequences: Tensor) -> Tensor:
    """Per token, the mean of `values` over the masked tokens of its sequence (0 for a
    sequence without any)."""
    flat, m, seq = values.flatten(), mask.flatten().to(values.dtype), sequences.flatten().long()
    n = int(seq.max()) + 1 if seq.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, flat * m)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, m)
    return (sums / counts.clamp(min=1))[seq].view_as(values)


@register_policy_loss("ppo_clip", dual_clip=True)
def _ppo_clip(logp, old_logp, advantages, *, mask, sequences, eps_low, eps_high, dual_clip):
    return policy_loss(logp, old_logp, advantages, eps_low=eps_low, eps_high=eps_high,
                       dual_clip=dual_clip)  # fmt: skip


@register_policy_loss("gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean",
                      sequence=True)  # fmt: skip
def gspo_loss(logp, old_logp, advantages, *, mask, sequences, eps_low, eps_high, dual_clip=None):
    """GSPO (Qwen, arXiv 2507.18071) in its GSPO-token form, as verl's "gspo":

        s_i     = exp(mean over response i's tokens of (logp - old_logp))
        s_i,t   = sg[s_i] * pi_t / sg[pi_t]      (value s_i; gradient s_i * grad log pi_t)
        loss_t  = max(-A * s_i,t, -A * clip(s_i,t, 1 - eps_low, 1 + eps_high))

    With one advantage per response and the sequence-level aggregation
    (seq-mean-token-mean, its registered default) this is GSPO's sequence loss, value and
    gradient (TRL's importance_sampling_level="sequence"). Its clip range is the paper's
    and verl's recipe's: eps_low 3e-4, eps_high 4e-4 (TRL's docs recommend the same)."""
    seq_log_ratio = sequence_means(logp - old_logp, mask, sequences)
    log_s = (logp - logp.detach() + seq_log_ratio.detach()).clamp(max=10.0)  # verl's clamp
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - eps_low, 1 + eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@register_policy_loss("cispo", clip_low=1.0, clip_high=4.0)
def cispo_loss(logp, old_logp, advantages, *, mask, sequences, eps_low, eps_high, dual_clip=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached,
    so every token keeps its gradient through log pi:

        loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * logp_t,  r_t = exp(logp - old)

    token-mean over the batch (its default aggregation). Default range: TRL's
    (loss_type="cispo": only an upper bound, epsilon_high=5.0 as ScaleRL recommends, i.e.
    eps_high 4.0 here; eps_low 1.0 leaves the weight unbounded below as the paper does).
    `clipped`: the weight was clipped."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return -weight * advantages * logp, (weight != ratio.detach()).float()


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS, Yao et al. "Your efficient RL framework secretly
    brings you off-policy RL training"; verl's `tis_imp_ratio_cap`, TRL's token_truncate):
    per token min(exp(old_logp - sampler_logp), cap), detached. It multiplies the policy
    loss so that samples the rollout engine drew with other numbers than the trainer's
    count as the trainer's policy would have drawn them."""
    return torch.exp((old_logp - sampler_logp).clamp(-20.0, 20.0)).clamp(max=cap).detach()
