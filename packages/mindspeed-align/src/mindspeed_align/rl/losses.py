"""Policy-gradient losses per token, KL estimators and loss aggregation, as pure functions.

Per token, with ratio = exp(logp - old_logp) and advantage A (verl's "vanilla" policy
loss, TRL's GRPO loss):

    pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))   PPO clip
    pg = min(pg, -A * c)  where A < 0                                   dual clip (c > 1)

eps_high > eps_low is DAPO's clip-higher. A KL penalty against a reference adds
kl_coef * k(logp, ref_logp) per token. `aggregate` turns per-token values into the loss
of a batch; the trainer uses `token_weights` (the same rule as weights over tokens) so
that the loss can be summed across micro-batches and ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "aggregate", "kl_estimate", "policy_loss",
           "token_weights", "value_loss"]  # fmt: skip

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
