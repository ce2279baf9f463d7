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
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from mindspeed_llm.data.collate import IGNORE_INDEX, SHARED_KEYS, Batch, forward_packed
from mindspeed_llm.data.sft import Sample, collate_rows, pack_rows
from mindspeed_llm.models.common.transformer import kept_positions
from mindspeed_llm.train.objectives import LossContext, token_nll
from mindspeed_ops.validate import remember_host_values

Pair = tuple[Sample, Sample]
"""(chosen, rejected): two SFT samples sharing a prompt."""
SLOT_KEY = "pair_slot"
"""The batch key of the per-token slot (see the module docstring)."""

__all__ = ["SLOT_KEY", "Pair", "count_pairs", "frozen_sequence_logps", "pack_pairs",
           "renumber_slots", "sequence_logps", "shared_prefix"]  # fmt: skip


def shared_prefix(pair: Pair) -> int:
    """How many leading tokens a pair's chosen and rejected sequences can share: their common
    prefix, short of the first supervised position of either (the token that predicts a
    reply's first token belongs to the reply's document)."""
    (c_ids, c_labels), (r_ids, r_labels) = pair
    limit = min(len(c_ids), len(r_ids))
    for lab in (c_labels, r_labels):
        supervised = np.flatnonzero(np.asarray(lab) != IGNORE_INDEX)
        limit = min(limit, int(supervised[0]) if supervised.size else len(lab))
    differ = np.flatnonzero(np.asarray(c_ids[:limit]) != np.asarray(r_ids[:limit]))
    return int(differ[0]) if differ.size else limit


def pack_pairs(pairs: Sequence[Pair], seq_len: int, pad_id: int, rows: int | None = None, *,
               share_prompts: bool = False) -> Batch:  # fmt: skip
    """Pairs -> one batch of rows `seq_len` wide, both sequences of a pair in the same row
    (rows filled best fit decreasing), with the per-token `pair_slot` key; `rows`: exactly
    that many rows, padded with empty ones (pipeline parallel needs one shape every step).

    `share_prompts`: a pair is three documents, its shared prefix (`shared_prefix`: the
    prompt but its last token) once, then the chosen and the rejected remainders, each
    attending to the prefix's keys and its own (the batch's `SHARED_KEYS`, the model's
    `SharedKeys`), their positions continuing the prefix's: the log-probs of two whole
    sequences from one forward of the prompt.

    Raises:
        ValueError: a pair is longer than `seq_len` (the data source drops or cuts those).
    """
    if share_prompts:
        return _pack_shared(pairs, seq_len, pad_id, rows)
    packed = _rows([len(c[0]) + len(r[0]) for c, r in pairs], seq_len, rows)
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


def _rows(lengths: list[int], seq_len: int, rows: int | None) -> list[list[int]]:
    """The pairs (of these token counts) of each row, best fit decreasing; `rows` of them
    exactly when given (empty ones added)."""
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(f"pairs {too_long} hold more than seq_len={seq_len} tokens")
    packed = pack_rows(lengths, seq_len)
    if rows is not None:
        if len(packed) > rows:
            raise ValueError(f"{len(lengths)} pairs need {len(packed)} rows, more than {rows}")
        packed += [[] for _ in range(rows - len(packed))]
    return packed


def _pack_shared(pairs: Sequence[Pair], seq_len: int, pad_id: int, rows: int | None) -> Batch:
    prefixes = [shared_prefix(p) for p in pairs]
    packed = _rows([len(c[0]) + len(r[0]) - s for (c, r), s in zip(pairs, prefixes, strict=True)],
                   seq_len, rows)  # fmt: skip
    # the documents of each row: (ids, labels, first position, slot, prefix document or None)
    docs_of_rows = []
    for row in packed:
        docs = []
        for i in row:
            (c_ids, c_labels), (r_ids, r_labels) = pairs[i]
            s = prefixes[i]
            prefix = None
            if s:
                prefix = len(docs)
                docs.append((c_ids[:s], c_labels[:s], 0, 2 * i, None))
            docs.append((c_ids[s:], c_labels[s:], s, 2 * i, prefix))
            docs.append((r_ids[s:], r_labels[s:], s, 2 * i + 1, prefix))
        docs_of_rows.append(docs)
    batch = collate_rows([[(d[0], d[1]) for d in docs] for docs in docs_of_rows], seq_len, pad_id)
    slots = torch.full_like(batch["input_ids"], -1)
    index, cu_k, offsets = [], [0], []
    for r, docs in enumerate(docs_of_rows):
        starts, start = [], 0
        for ids, _, first, slot, prefix in docs:
            starts.append(start)
            end = start + len(ids)
            slots[r, start:end] = slot
            batch["position_ids"][r, start:end] += first
            keys = []
            if prefix is not None:
                keys.append(range(r * seq_len + starts[prefix], r * seq_len + starts[prefix] + first))
            keys.append(range(r * seq_len + start, r * seq_len + end))
            index += [t for k in keys for t in k]
            cu_k.append(len(index))
            offsets.append(first if prefix is not None else 0)
            start = end
        if start < seq_len:  # the padding: a document on its own
            index += range(r * seq_len + start, (r + 1) * seq_len)
            cu_k.append(len(index))
            offsets.append(0)
    batch[SLOT_KEY] = slots
    values = (torch.tensor(index, dtype=torch.long), torch.tensor(cu_k, dtype=torch.int32),
              torch.tensor(offsets, dtype=torch.long))  # fmt: skip
    batch.update(zip(SHARED_KEYS, values, strict=True))
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


def slot_count_tensor(num_slots: int) -> Tensor:
    """An objective's targets entry "num_slots": a tensor (targets are tensors) whose value
    the host knows without reading it (`mindspeed_ops.validate.host_values`), on any device
    the step moves it to."""
    return remember_host_values(torch.tensor(num_slots), num_slots)


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


@torch.no_grad()
def frozen_sequence_logps(model, batch: Batch, slots: Tensor, num_slots: int,
                          ctx: LossContext | None, *, keep: Tensor | None = None,
                          fused: bool = False) -> Tensor:  # fmt: skip
    """`sequence_logps` of a frozen model (a reference) on `batch`, without gradient.

    Args:
        keep: project only these positions (the supervised ones), else every position.
        fused: where the model can (`Transformer.fuses_nll`), each token's log-prob comes
            from the fused linear + cross-entropy op: no logits are held, for the same
            FLOPs (no backward here to recompute for).
    """
    labels, extra = batch["labels"], {} if keep is None else {"keep": keep}
    if fused and getattr(model, "fuses_nll", False):
        extra["nll_labels"], ctx = labels, replace(ctx or LossContext(), token_nll=True)
    outputs = forward_packed(model, batch, **extra)
    if keep is not None:
        labels, slots = kept_positions(labels, keep), kept_positions(slots, keep)
    return sequence_logps(outputs, labels, slots, num_slots, ctx)[0]
