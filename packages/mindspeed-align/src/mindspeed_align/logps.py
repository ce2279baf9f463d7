"""Per-sequence log-probs of preference pairs packed into rows.

A pair's chosen and rejected sequences (each the prompt plus one reply, encoded as an SFT
`Sample`: ids and shifted labels, the reply supervised) are two documents of one packed row,
separated by `cu_seqlens`, so one forward serves both and attention never crosses them. Each
token also carries its *slot*, a per-token key of the batch: ``2·p`` for the chosen sequence of
pair ``p``, ``2·p + 1`` for its rejected one, -1 for padding. Summing the supervised tokens'
log-probs by slot gives every sequence's log-prob and token count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mindspeed_llm.data.collate import IGNORE_INDEX, Batch
from mindspeed_llm.data.sft import Sample, collate_rows, pack_rows
from mindspeed_llm.train.objectives import LossContext, token_nll

Pair = tuple[Sample, Sample]
"""(chosen, rejected): two SFT samples sharing a prompt."""
SLOT_KEY = "pair_slot"
"""The batch key of the per-token slot (see the module docstring)."""

__all__ = ["SLOT_KEY", "Pair", "count_pairs", "pack_pairs", "renumber_slots", "sequence_logps"]


def pack_pairs(pairs: Sequence[Pair], seq_len: int, pad_id: int, rows: int | None = None) -> Batch:
    """Pairs -> one batch of rows `seq_len` wide, both sequences of a pair in the same row
    (rows filled best fit decreasing), with the per-token `pair_slot` key; `rows`: exactly
    that many rows, padded with empty ones (pipeline parallel needs one shape every step).

    Raises:
        ValueError: a pair is longer than `seq_len` (the data source drops or cuts those).
    """
    lengths = [len(c[0]) + len(r[0]) for c, r in pairs]
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(f"pairs {too_long} hold more than seq_len={seq_len} tokens")
    packed = pack_rows(lengths, seq_len)
    if rows is not None:
        if len(packed) > rows:
            raise ValueError(f"{len(pairs)} pairs need {len(packed)} rows, more than {rows}")
        packed += [[] for _ in range(rows - len(packed))]
    batch = collate_rows([[s for i in row for s in pairs[i]] for row in packed], seq_len, pad_id)
    slots = torch.full_like(batch["input_ids"], -1)
    for r, row in enumerate(packed):
        start = 0
        for i in row:
            for side, (ids, _) in enumerate(pairs[i]):
                slots[r, start : start + len(ids)] = 2 * i + side
                start += len(ids)
    batch[SLOT_KEY] = slots
    return batch


def renumber_slots(slots: Tensor) -> Tensor:
    """Slots 0, 1, ... again, in order, for a batch whose pairs are numbered from elsewhere
    (under pipeline parallel a step's micro-batches carry step-wide pair numbers and the
    schedule re-splits their rows); the side (slot % 2) is kept, padding stays -1. The
    identity on a micro-batch numbered from 0."""
    keep = slots >= 0
    _, pair = torch.unique(slots[keep] // 2, return_inverse=True)
    out = torch.full_like(slots, -1)
    out[keep] = 2 * pair + slots[keep] % 2
    return out


def count_pairs(slots: Tensor) -> int:
    """The pairs a batch holds (its distinct slot // 2)."""
    return int(torch.unique(slots[slots >= 0] // 2).numel())


def sequence_logps(
    logits: Tensor, labels: Tensor, slots: Tensor, num_slots: int, ctx: LossContext | None = None
) -> tuple[Tensor, Tensor]:
    """Per-slot sums of the supervised tokens' log-probs, and their counts.

    Args:
        logits: (batch, seq, vocab) model outputs (vocabulary-sharded under loss parallel).
        labels: (batch, seq) shifted labels, -100 where unsupervised.
        slots: (batch, seq) slot of each token, -1 for padding.
        num_slots: 2 × the pairs of the batch.
        ctx: how the logits were computed (default: plain local logits).

    Returns:
        (num_slots,) fp32 log-prob sums (differentiable) and (num_slots,) supervised token counts.
    """
    nll = token_nll(logits, labels, ctx or LossContext(), reduction="none")
    supervised = (labels.flatten() != IGNORE_INDEX) & (slots.flatten() >= 0)
    index = slots.flatten().clamp(min=0)
    logps = torch.zeros(num_slots, dtype=torch.float32, device=logits.device)
    logps = logps.index_add(0, index, torch.where(supervised, -nll.float(), 0.0))
    counts = torch.zeros(num_slots, dtype=torch.float32, device=logits.device)
    counts = counts.index_add(0, index, supervised.float())
    return logps, counts
