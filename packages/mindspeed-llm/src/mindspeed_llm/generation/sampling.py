"""From next-token logits to tokens, with transformers' logits processors' exact semantics.

Order as in `transformers.generate`: repetition penalty, then (sampling only) temperature,
top-k, top-p; greedy takes the argmax after the penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mindspeed_llm.generation.config import GenerationConfig


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Logits of tokens marked in `seen` (batch, vocab) bool: positive / penalty,
    negative * penalty (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(scores: Tensor, k: int) -> Tensor:
    """-inf below the k-th largest score of each row (ties with it survive)."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(scores: Tensor, p: float) -> Tensor:
    """-inf outside the smallest set of most likely tokens whose probability reaches p
    (the most likely token always stays)."""
    if p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def process_logits(logits: Tensor, config: GenerationConfig, seen: Tensor | None) -> Tensor:
    """fp32 scores the next token is drawn from: penalised, and when sampling scaled by
    the temperature and filtered by top-k and top-p (removed tokens are -inf)."""
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, config.repetition_penalty)
    if config.greedy:
        return scores
    scores = scores / config.temperature
    return top_p_filter(top_k_filter(scores, config.top_k), config.top_p)


def next_tokens(
    logits: Tensor,
    config: GenerationConfig,
    seen: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(batch,) next tokens from (batch, vocab) logits."""
    scores = process_logits(logits, config, seen)
    if config.greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
