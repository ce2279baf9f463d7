"""Preference losses as pure functions of per-sequence log-probs.

Every function takes per-sequence log-probabilities (shape ``(batch,)``), already reduced over the
completion tokens the way the method asks: a sum for DPO (``sigmoid``/``hinge``/``robust``) and
KTO, a length average for SimPO and ORPO, and sums plus lengths for IPO (which averages the
log-ratios per token, as TRL does after confirming with the IPO authors). They return the
per-example loss (the caller takes the mean) and the implicit rewards TRL logs.

Naming follows TRL (``beta``, ``label_smoothing``, ``simpo_gamma``, ``desirable_weight``); where
TRL and MindSpeed-LLM differ the MindSpeed-LLM convention is kept and said so: ``sigmoid`` with
``label_smoothing > 0`` is conservative DPO (cDPO, as MindSpeed-LLM and OpenRLHF and TRL <= 0.28
compute it; TRL >= 0.29 ignores label smoothing for ``sigmoid``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")
"""The DPO loss variants :func:`dpo_loss` knows."""


@dataclass(kw_only=True)
class PreferenceOutput:
    """What a preference loss gives back for one batch of pairs (or unpaired examples)."""

    losses: Tensor
    """Per-example loss, shape ``(batch,)``; the training loss is its mean."""
    chosen_rewards: Tensor
    """Implicit reward of each chosen reply (detached), as TRL logs ``rewards/chosen``."""
    rejected_rewards: Tensor
    """Implicit reward of each rejected reply (detached), as TRL logs ``rewards/rejected``."""


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> PreferenceOutput:
    """Direct preference optimisation and its variants.

    With log-ratios ``ρ_w = logπ(y_w) − logπref(y_w)``, ``ρ_l = logπ(y_l) − logπref(y_l)`` (sums over
    the completion tokens), ``Δ = ρ_w − ρ_l`` and ``ε = label_smoothing``:

    - ``sigmoid`` (DPO; cDPO when ε > 0): ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)``
    - ``hinge`` (SLiC): ``relu(1 − βΔ)``
    - ``ipo``: ``(ρ_w/|y_w| − ρ_l/|y_l| − 1/(2β))²``, the log-ratios averaged per completion token
      (TRL's convention; ``chosen_lengths``/``rejected_lengths`` are required)
    - ``robust`` (rDPO, unbiased under label noise ε < 0.5):
      ``[−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)] / (1 − 2ε)``

    Rewards are ``β·ρ_w`` and ``β·ρ_l`` (sum log-ratios, every variant), as TRL logs them.
    """
    if loss not in DPO_LOSSES:
        raise ValueError(f"dpo loss {loss!r} is not one of {DPO_LOSSES}")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    logits = beta * (chosen_ratio - rejected_ratio)
    eps = label_smoothing
    if loss == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    elif loss == "hinge":
        losses = torch.relu(1 - logits)
    elif loss == "robust":
        losses = (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    else:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("the ipo loss needs chosen_lengths and rejected_lengths")
        delta = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    return PreferenceOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """SimPO: reference-free, length-averaged log-probs with a target margin ``γ``.

    With ``Δ = logπ(y_w)/|y_w| − logπ(y_l)/|y_l|`` and ``z = β·Δ − γ``:
    ``loss = −(1−ε)·logσ(z) − ε·logσ(−z)`` (TRL's CPO trainer with ``loss_type="simpo"``, where
    ``gamma`` is TRL's ``simpo_gamma``; MindSpeed-LLM's ``gamma_beta_ratio`` is ``γ/β``).
    Rewards are ``β·logπ(y)/|y|``. SimPO proper has no NLL term (TRL's ``cpo_alpha=0``).
    """
    logits = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    eps = label_smoothing
    losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    return PreferenceOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_avg_logps).detach(),
        rejected_rewards=(beta * rejected_avg_logps).detach(),
    )


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, *, beta: float = 0.1) -> PreferenceOutput:
    """ORPO's odds-ratio term (reference-free, length-averaged log-probs ``p = logπ(y)/|y|``).

    ``log_odds = (p_w − p_l) − (log(1 − e^{p_w}) − log(1 − e^{p_l}))``; the per-pair loss here is
    ``−β·logσ(log_odds)``; the full ORPO objective adds the NLL of the chosen reply:
    ``NLL(y_w) + mean(losses)`` (TRL's ``odds_ratio_loss``; β is the paper's λ). Rewards are
    ``β·p``.
    """
    chosen = chosen_avg_logps.float()
    rejected = rejected_avg_logps.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return PreferenceOutput(
        losses=-beta * F.logsigmoid(log_odds),
        chosen_rewards=(beta * chosen).detach(),
        rejected_rewards=(beta * rejected).detach(),
    )


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 − e^x)`` for ``x < 0``, stable at both ends (Mächler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def kto_kl_estimate(
    kl_logps: Tensor, ref_kl_logps: Tensor, *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """KTO's reference point ``z_ref = max(0, mean(logπ(y'|x) − logπref(y'|x)))``.

    ``y'`` are mismatched completions (each prompt with another example's completion). The mean is
    detached and averaged over the data-parallel ranks of ``group`` (when given and initialised),
    as TRL gathers it, so every rank uses the same baseline.
    """
    kl = (kl_logps - ref_kl_logps).mean().detach()
    if group is not None and dist.is_available() and dist.is_initialized():
        kl = kl.clone()
        dist.all_reduce(kl, op=dist.ReduceOp.SUM, group=group)
        kl = kl / dist.get_world_size(group)
    return kl.clamp(min=0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceOutput:
    """KTO for unpaired examples (``labels`` true = desirable, false = undesirable).

    With ``ρ = logπ(y|x) − logπref(y|x)`` (sums) and the detached reference point ``z`` from
    :func:`kto_kl_estimate`: desirable ``w_d·(1 − σ(β(ρ − z)))``, undesirable
    ``w_u·(1 − σ(β(z − ρ)))``. ``losses`` keeps the input order (its mean is TRL's loss);
    ``chosen_rewards``/``rejected_rewards`` are ``β·ρ`` of the desirable/undesirable examples.
    """
    ratio = logps - ref_logps
    desirable = labels.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    rewards = (beta * ratio).detach()
    return PreferenceOutput(losses=losses, chosen_rewards=rewards[desirable], rejected_rewards=rewards[~desirable])


def reward_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    *,
    margin: Tensor | float | None = None,
    center_coefficient: float | None = None,
) -> Tensor:
    """Pairwise (Bradley-Terry) loss of a reward model, per pair.

    With scores ``r_w`` (chosen) and ``r_l`` (rejected), optional margin ``m`` and centring
    coefficient ``c``: ``−logσ(r_w − r_l − m) + c·(r_w + r_l)²``. The mean over pairs is TRL's
    ``RewardTrainer`` loss (``margin`` column, ``center_rewards_coefficient``; OpenRLHF's
    ``PairWiseLoss`` without centring).
    """
    diff = chosen_scores.float() - rejected_scores.float()
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen_scores.float() + rejected_scores.float()) ** 2
    return losses


def reward_metrics(out: PreferenceOutput) -> dict[str, float]:
    """TRL's reward metrics for a pairwise batch: ``rewards/{chosen,rejected,margins,accuracies}``."""
    margins = out.chosen_rewards - out.rejected_rewards
    return {
        "rewards/chosen": out.chosen_rewards.mean().item(),
        "rewards/rejected": out.rejected_rewards.mean().item(),
        "rewards/margins": margins.mean().item(),
        "rewards/accuracies": (margins > 0).float().mean().item(),
    }
