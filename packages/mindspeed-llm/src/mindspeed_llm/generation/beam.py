"""Beam search with the KV cache, with Hugging Face's meaning of every setting.

Each prompt keeps `num_beams` running beams (prefilled once, its keys and values copied to
every beam). A step scores every (beam, token) continuation by its summed log-probability,
keeps the best `2 * num_beams` of them (more with several stop tokens), continues the best
`num_beams` that did not stop, and files those of the best `num_beams` that stopped (a stop
token, or the length limit) among the prompt's finished beams, scored by
`sum log p / generated_length ** length_penalty`. Search for a prompt ends as transformers'
does: with `early_stopping=True` once `num_beams` beams have finished; with `False` (the
default) once no running beam, scored at its current length, could beat the worst finished
one; with `"never"` also allowing for a longer beam when `length_penalty > 0`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mindspeed_core.parallel import dtensor
from mindspeed_llm.generation.config import GenerationConfig
from mindspeed_llm.generation.kv_cache import KVCache

_NEG = -1.0e9  # "never": added to a score (transformers' constant, kept for equal ties)


@dataclass(frozen=True)
class Beam:
    """One finished beam: its new tokens (a stop token last, if it stopped on one) and its
    length-penalised score."""

    tokens: list[int]
    score: float


@torch.inference_mode()
def beam_search(
    model: nn.Module, prompts: list[list[int]], config: GenerationConfig, max_new_tokens: int
) -> list[list[Beam]]:
    """The `config.num_beams` finished beams of each prompt, best first."""
    k, batch = config.num_beams, len(prompts)
    device = dtensor.local(model.tok_embeddings.weight).device
    stop_ids = torch.tensor(sorted(config.stop_token_ids), dtype=torch.long, device=device)
    keep = max(2, 1 + len(config.stop_token_ids)) * k  # continuations looked at per step
    top_k_mask = torch.arange(keep, device=device) < k

    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    tokens = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)], device=device)
    positions = (torch.arange(longest, device=device)[None] - torch.tensor(pads, device=device)[:, None])
    cache = KVCache.for_model(model, batch, longest + max_new_tokens)
    cache.reset(pads)
    logits = dtensor.full(model(tokens, position_ids=positions.clamp_(min=0), kv_cache=cache,
                                logits_to_keep=1))[:, -1]  # fmt: skip
    cache.repeat_rows(k)
    logits = logits.repeat_interleave(k, dim=0)
    positions = torch.tensor(lengths, device=device).repeat_interleave(k)[:, None]

    running = torch.zeros(batch, k, 0, dtype=torch.long, device=device)  # new tokens so far
    running_scores = torch.full((batch, k), _NEG, device=device)
    running_scores[:, 0] = 0.0  # the first step expands one beam, not k copies of it
    done = torch.full((batch, k, max_new_tokens), -1, dtype=torch.long, device=device)
    done_lengths = torch.zeros(batch, k, dtype=torch.long, device=device)
    done_scores = torch.full((batch, k), _NEG, device=device)
    is_done = torch.zeros(batch, k, dtype=torch.bool, device=device)
    may_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)
    offsets = torch.arange(batch, device=device)[:, None] * k

    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        vocab = logp.shape[-1]
        total = (logp.view(batch, k, vocab) + running_scores[:, :, None]).view(batch, k * vocab)
        cand_scores, flat = torch.topk(total, keep)
        parents, cand_tokens = flat // vocab, flat % vocab
        cand = torch.cat([_gather(running, parents), cand_tokens[:, :, None]], dim=2)
        stops = torch.isin(cand_tokens, stop_ids) | (step + 1 == max_new_tokens)

        # the best k continuations that did not stop run on
        alive = cand_scores + stops.float() * _NEG
        best = torch.topk(alive, k).indices
        running, running_scores = _gather(cand, best), _gather(alive, best)
        parents = _gather(parents, best)

        # the best k that stopped join the finished ones, if they beat them
        length = step + 1
        final = cand_scores / length**config.length_penalty
        full = is_done.all(dim=1, keepdim=True) & (config.early_stopping is True)
        newly = stops & top_k_mask[None]
        final = final + full.float() * _NEG + (~may_improve).float() * _NEG + (~newly).float() * _NEG
        padded = torch.full((batch, keep, max_new_tokens), -1, dtype=torch.long, device=device)
        padded[:, :, :length] = cand
        merged = torch.topk(torch.cat([done_scores, final], dim=1), k).indices
        done = _gather(torch.cat([done, padded], dim=1), merged)
        done_scores = _gather(torch.cat([done_scores, final], dim=1), merged)
        done_lengths = _gather(torch.cat([done_lengths, torch.full_like(final, length, dtype=torch.long)], dim=1), merged)
        is_done = _gather(torch.cat([is_done, newly], dim=1), merged)

        may_improve = may_improve & _may_improve(running_scores, done_scores, is_done, length,
                                                 max_new_tokens, config)  # fmt: skip
        if (
            not may_improve.any()
            or (is_done.all() and config.early_stopping is True)
            or stops.all()
        ):
            break
        cache.keep_rows((parents + offsets).flatten())
        logits = dtensor.full(model(running[:, :, -1].reshape(-1, 1), position_ids=positions,
                                    kv_cache=cache))[:, -1]  # fmt: skip
        positions = positions + 1

    return [
        [Beam(done[b, i, : done_lengths[b, i]].tolist(), float(done_scores[b, i])) for i in range(k)]
        for b in range(batch)
    ]


def _gather(values: Tensor, index: Tensor) -> Tensor:
    """values[b, index[b, j], ...] for every prompt b."""
    index = index.reshape(*index.shape, *([1] * (values.dim() - 2)))
    return values.gather(1, index.expand(*index.shape[:2], *values.shape[2:]))


def _may_improve(
    running_scores: Tensor,
    done_scores: Tensor,
    is_done: Tensor,
    length: int,
    max_new_tokens: int,
    config: GenerationConfig,
) -> Tensor:
    """(batch, 1): may a running beam still beat a finished one (transformers' heuristic:
    the best running beam's score at the current length, or at the longest one with
    `early_stopping="never"` and a positive length penalty)."""
    if config.early_stopping == "never" and config.length_penalty > 0:
        length = max_new_tokens
    best = running_scores[:, :1] / length**config.length_penalty
    worst = torch.where(is_done, done_scores.min(dim=1, keepdim=True).values, _NEG)
    return (best > worst).any(dim=-1, keepdim=True)
