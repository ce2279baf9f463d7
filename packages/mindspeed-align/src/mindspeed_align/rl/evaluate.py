"""Held-out evaluation of a policy through its rollout: the mean reward of greedy (or
sampled) completions, or of episodes in an environment (`mindspeed grpo` prints both
before and after training)."""

from __future__ import annotations

import math

import torch

from mindspeed_align.rl.env import run_episodes
from mindspeed_align.rl.rewards import Rewards
from mindspeed_align.rl.rollout import LocalRollout, SamplingConfig
from mindspeed_llm.chat_template import encode_text

__all__ = ["evaluate_episodes", "evaluate_reward"]


@torch.no_grad()
def evaluate_reward(rollout: LocalRollout, records, tokenizer, rewards: Rewards,
                    max_new_tokens: int, *, temperature: float = 0.0, n: int = 1,
                    seed: int = 0) -> float:  # fmt: skip
    """Mean reward of `n` completions of each of `records` (greedy at temperature 0)."""
    if not records:
        return math.nan
    stops = () if tokenizer.eod_id is None else (tokenizer.eod_id,)
    cfg = SamplingConfig(n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                         stop_token_ids=stops)  # fmt: skip
    total = []
    for lo in range(0, len(records), 64):
        chunk = records[lo : lo + 64]
        batch = rollout.generate(
            [encode_text(tokenizer, r["prompt"]) for r in chunk], cfg, seed=seed
        )
        rows = [chunk[g] for g in batch.group]
        texts = [tokenizer.decode([t for t in r if t not in stops]) for r in batch.response_ids]
        names = [k for k in chunk[0] if k != "prompt"]
        scores, _ = rewards([r["prompt"] for r in rows], texts,
                            {k: [r.get(k) for r in rows] for k in names})  # fmt: skip
        total += scores
    return sum(total) / len(total)


@torch.no_grad()
def evaluate_episodes(rollout: LocalRollout, env, records, tokenizer, template, rl, *,
                      temperature: float = 0.0, n: int = 1, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """(mean reward, tool calls per episode) of `n` episodes of each of `records` (greedy at
    temperature 0) in the environment class `env`."""
    if not records:
        return math.nan, math.nan
    stops = () if tokenizer.eod_id is None else (tokenizer.eod_id,)
    cfg = SamplingConfig(n=n, max_new_tokens=rl.max_new_tokens, temperature=temperature,
                         stop_token_ids=stops)  # fmt: skip
    rewards, calls = [], 0.0
    for lo in range(0, len(records), 64):
        chunk = records[lo : lo + 64]
        episodes = run_episodes(rollout, env, chunk, [encode_text(tokenizer, r["prompt"]) for r in chunk],
                                cfg, template=template, tokenizer=tokenizer, seed=seed,
                                max_turns=rl.env_max_turns, max_tokens=rl.env_max_tokens)  # fmt: skip
        rewards += episodes.rewards
        calls += episodes.metrics["env/tool_calls"] * len(episodes.rewards)
    return sum(rewards) / len(rewards), calls / len(rewards)
