"""Advantage estimators of policy-gradient RL for LLMs, as pure tensor functions.

Outcome rewards are one scalar per sampled response; `group` gives the index of the
prompt each response answers (GRPO's group of `n` samples). Token-level estimators take
(batch, tokens) rewards and a response mask. Conventions follow verl's `core_algos` and
TRL's `GRPOTrainer`/`RLOOTrainer`; each docstring states its formula.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "overlong_penalty",
    "dr_grpo",
    "gae",
    "group_normalized",
    "group_stats",
    "masked_whiten",
    "register_advantage",
    "reinforce_pp",
    "rloo",
    "token_advantages",
]

PerToken = Callable[..., list[list[float]]]
"""An estimator: (rewards, group, lengths, *, eps) -> each response's per-token advantages;
rewards: (samples,) float64 outcome rewards, group: (samples,) the prompt index of each,
lengths: each response's token count."""


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator (`grpo.advantage` names it)."""

    fn: PerToken | None
    """None: computed by the method's own step (PPO's GAE, which needs the critic)."""
    group: bool = False
    """It compares the samples of one prompt: the config needs n >= 2 of them."""
    critic: bool = False
    """It needs a value model: `mindspeed ppo` only."""


ESTIMATORS: dict[str, Estimator] = {}
"""Every advantage estimator by its config name; `register_advantage` adds one."""


def register_advantage(name: str, *, group: bool = False, critic: bool = False):
    """Register `fn(rewards, group, lengths, *, eps)` as the estimator `name`: one decorated
    function makes `--grpo.advantage NAME` train with it (verl's `register_adv_est`)."""

    def add(fn: PerToken | None) -> PerToken | None:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered already")
        ESTIMATORS[name] = Estimator(fn, group=group, critic=critic)
        return fn

    return add


def token_advantages(kind: str, rewards: list[float], group: list[int], lengths: list[int],
                     *, eps: float = 1e-6) -> list[list[float]]:  # fmt: skip
    """Per response token advantages of outcome rewards by the registered estimator `kind`."""
    estimator = ESTIMATORS[kind]
    if estimator.fn is None:
        raise ValueError(f"advantage {kind!r} is computed by its method's step (a critic)")
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(group)
    return estimator.fn(r, g, lengths, eps=eps)


def _each_token(per_sample: Tensor, lengths: list[int]) -> list[list[float]]:
    """One advantage per response, repeated over its tokens."""
    return [[float(a)] * n for a, n in zip(per_sample.tolist(), lengths, strict=True)]


def group_stats(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per response: the mean and the unbiased std of its group's rewards, and the size
    of its group (torch.std's n - 1 denominator, as TRL and verl; 0 for a group of 1)."""
    group = group.long()
    n_groups = int(group.max()) + 1 if group.numel() else 0
    rewards = rewards.double()
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(
        0, group, torch.ones_like(rewards)
    )
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, rewards)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(
        0, group, (rewards - mean[group]) ** 2
    )
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[group], std[group], count[group]


def group_normalized(
    rewards: Tensor, group: Tensor, *, scale: str = "group", eps: float = 1e-6
) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), mean and unbiased std over the group
    g of response i. scale="batch": std over the whole batch (TRL's "batch");
    scale="none": A_i = r_i - mean_g (Dr.GRPO). eps: 1e-6 in verl, 1e-4 in TRL."""
    mean, std, _ = group_stats(rewards, group)
    centred = rewards.double() - mean
    if scale == "none":
        return centred.to(rewards.dtype)
    if scale == "batch":
        std = rewards.double().std().expand_as(centred)
    elif scale != "group":
        raise ValueError(f"scale={scale!r} is not 'group', 'batch' or 'none'")
    return (centred / (std + eps)).to(rewards.dtype)


def dr_grpo(rewards: Tensor, group: Tensor) -> Tensor:
    """Dr.GRPO ("GRPO done right"): A_i = r_i - mean_g, no division by the std."""
    return group_normalized(rewards, group, scale="none")


def rloo(rewards: Tensor, group: Tensor) -> Tensor:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j = n/(n-1) * (r_i - mean_g) for a group
    of n >= 2 (a group of 1 gets A = 0)."""
    mean, _, count = group_stats(rewards, group)
    loo = (rewards.double() - mean) * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, loo, torch.zeros_like(loo)).to(rewards.dtype)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased var; verl's
    `masked_whiten`); shift_mean=False adds the mean back."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = (((values - mean) ** 2) * mask).sum() / count
    var = var * count / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} along the tokens (masked positions carry no reward and
    reset nothing: verl's reinforce++ resets the running return after padding)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


def reinforce_pp(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: per token the discounted return G_t = sum_{k>=t} gamma^(k-t) r_k,
    then whitened over every response token of the batch (verl's
    `compute_reinforce_plus_plus_outcome_advantage`); 0 outside the mask.
    Outcome rewards go on each response's last token."""
    returns = _discounted_returns(token_rewards, mask.to(token_rewards.dtype), gamma)
    return masked_whiten(returns, mask) * mask


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """GAE (Schulman et al. 2016), verl's `compute_gae_advantage_return`:
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}
    (V and A after a response's last token are 0), returns = A + V, then A whitened over
    the response tokens (whiten=False: not; the caller whitens over a larger batch).
    Returns (advantages, 0 outside the mask; returns)."""
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_new = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = last_new * mask[:, t] + (1 - mask[:, t]) * last
        advantages[:, t] = last
    returns = advantages + values
    return (masked_whiten(advantages, mask) if whiten else advantages) * mask, returns


def overlong_penalty(lengths: list[int], max_len: int, buffer: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (verl's `overlong_buffer`): a response longer than
    max_len - buffer loses (length - (max_len - buffer)) / buffer x factor, growing linearly
    to `factor` at max_len; shorter ones lose nothing. Added to the outcome reward."""
    expected = max_len - buffer
    return [min(-(n - expected) / buffer * factor, 0.0) for n in lengths]


# -- the registered estimators --------------------------------------------------------------


@register_advantage("grpo", group=True)
def _grpo(rewards: Tensor, group: Tensor, lengths: list[int], *, eps: float) -> list[list[float]]:
    return _each_token(group_normalized(rewards, group, eps=eps), lengths)


@register_advantage("dr_grpo", group=True)
def _dr_grpo(rewards: Tensor, group: Tensor, lengths: list[int], *, eps: float) -> list[list[float]]:
    return _each_token(dr_grpo(rewards, group), lengths)


@register_advantage("rloo", group=True)
def _rloo(rewards: Tensor, group: Tensor, lengths: list[int], *, eps: float) -> list[list[float]]:
    return _each_token(rloo(rewards, group), lengths)


@register_advantage("reinforce_pp")
def _reinforce_pp(rewards: Tensor, group: Tensor, lengths: list[int], *, eps: float) -> list[list[float]]:
    """The outcome reward on each response's last token, REINFORCE++ over the batch."""
    width = max(lengths)
    mask = torch.tensor([[float(t < n) for t in range(width)] for n in lengths])
    token_rewards = torch.zeros(len(lengths), width, dtype=torch.float64)
    token_rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = rewards
    per_token = reinforce_pp(token_rewards, mask.double())
    return [per_token[i, :n].tolist() for i, n in enumerate(lengths)]


register_advantage("gae", critic=True)(None)  # PPO's step: GAE over the critic's values
