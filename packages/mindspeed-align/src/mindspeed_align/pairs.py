"""Preference pairs: records -> encoded (chosen, rejected) samples -> packed micro-batches.

A record is `{prompt, chosen, rejected}` (strings, TRL's standard format) or a pairwise record
with a message-list prompt (`mindspeed_llm.data.sft_records.pairwise_messages`: prompt,
instruction/input, conversations or messages, plus chosen and rejected). Each side is the prompt
plus its reply, encoded with the run's chat template as an SFT sample (only the reply
supervised). `PairData` is SFT's data source (`mindspeed_llm.train.sft_data.SFTData`: sampler,
validation split, exact resume) whose unit is a pair: `train.micro_batch` counts pairs, and a
micro-batch packs them (`logps.pack_pairs`) with both sides of a pair in one row.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from mindspeed_align.logps import SLOT_KEY, Pair, pack_pairs
from mindspeed_align.reference import put_ref_logps
from mindspeed_core.errors import DataError
from mindspeed_llm.data.collate import IGNORE_INDEX, Batch
from mindspeed_llm.data.sft import SFTStats, encode_sample
from mindspeed_llm.data.sft_records import (
    RAW_SUFFIXES,
    RecordError,
    pairwise_messages,
    read_records,
)
from mindspeed_llm.train.sft_data import SFTData

__all__ = ["PAIRWISE_KEYS", "PairData", "encode_pair", "load_pairs", "read_pairwise_prefix"]

logger = logging.getLogger("mindspeed.dpo")


def encode_pair(template, tokenizer, record, where: str) -> Pair:
    """A record's (chosen, rejected) samples.

    Raises:
        DataError: naming `where` (file:line): a bad record, chosen equal to rejected, or a
            prompt whose tokens are not the same before both replies.
    """
    try:
        chosen_msgs, rejected_msgs = pairwise_messages(record)
    except RecordError as err:
        raise DataError(f"{where}: {err}") from None
    if chosen_msgs[-1]["content"] == rejected_msgs[-1]["content"]:
        raise DataError(f"{where}: chosen and rejected are the same reply; a pair must differ")
    try:
        chosen, rejected = (encode_sample(template, tokenizer, m) for m in (chosen_msgs, rejected_msgs))
    except DataError as err:  # no reply, or a template that cannot run
        raise DataError(f"{where}: {err}") from None
    if not np.array_equal(_prompt(chosen), _prompt(rejected)):
        raise DataError(f"{where}: the prompt's tokens differ before the chosen and the rejected "
                        "reply (the chat template or tokenizer merges prompt and reply)")  # fmt: skip
    return chosen, rejected


def _prompt(sample) -> np.ndarray:
    """The ids before the first supervised token (labels are shifted by one)."""
    ids, labels = sample
    first = int(np.argmax(labels != IGNORE_INDEX))
    return ids[: first + 1]


def load_pairs(data, template, tokenizer) -> tuple[list[Pair], SFTStats]:
    """Every pair of `data.paths` (.json/.jsonl/.parquet, or `preprocess --handler-name
    pairwise` prefixes: ours or MindSpeed-LLM's); pairs longer than `data.seq_len` (both
    sides together, they share a row) are left out and counted as dropped."""
    stats, pairs = SFTStats(), []
    for path in data.paths:
        if Path(path).suffix.lower() in RAW_SUFFIXES:
            found = (encode_pair(template, tokenizer, record, where)
                     for where, record in read_records(Path(path), expect="pairwise"))  # fmt: skip
        else:
            found = read_pairwise_prefix(path)
        for pair in found:
            stats.records += 1
            if len(pair[0][0]) + len(pair[1][0]) > data.seq_len:
                stats.dropped += 1
                continue
            pairs.append(pair)
    stats.samples = len(pairs)
    if not pairs:
        raise DataError(f"data.paths {data.paths}: no pair fits data.seq_len={data.seq_len} ({stats.line()})")
    return pairs, stats


PAIRWISE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
"""The datasets of a pairwise prefix: `{prefix}_packed_{key}_document.{bin,idx}` (MindSpeed-LLM's
names; labels aligned with the ids, -100 on the prompt)."""


def read_pairwise_prefix(prefix: str | Path) -> list[Pair]:
    """The pairs of a pairwise prefix (`mindspeed preprocess --handler-name pairwise`, or
    MindSpeed-LLM's `preprocess_data.py` with a pairwise handler); labels shifted to ours."""
    from mindspeed_llm.data.indexed import IndexedDataset, dataset_exists

    names = {k: f"{prefix}_packed_{k}_document" for k in PAIRWISE_KEYS}
    missing = [n for n in names.values() if not dataset_exists(n)]
    if missing:
        raise DataError(f"data.paths: {missing[0]}.bin/.idx not found (from prefix {prefix}; a raw "
                        "file needs .json/.jsonl/.parquet, a prefix the four pairwise datasets)")  # fmt: skip
    sets = {k: IndexedDataset(n) for k, n in names.items()}
    counts = {k: len(d) for k, d in sets.items()}
    if len(set(counts.values())) != 1:
        raise DataError(f"{prefix}: the pairwise datasets hold different numbers of samples: {counts}")
    pairs = []
    for i in range(counts["chosen_input_ids"]):
        sides = []
        for side in ("chosen", "rejected"):
            ids = np.asarray(sets[f"{side}_input_ids"][i], np.int64)
            labels = np.asarray(sets[f"{side}_labels"][i], np.int64)
            if labels.shape != ids.shape:
                raise DataError(f"{prefix}: sample {i}: {side} labels and ids differ in length")
            sides.append((ids, np.concatenate([labels[1:], [IGNORE_INDEX]])))
        pairs.append(tuple(sides))
    return pairs


class PairData(SFTData):
    """SFT's data source with pairs as units (see the module docstring)."""

    def use_demo(self, cfg) -> None:
        from mindspeed_align.dpo_demo import use_demo_pairs

        use_demo_pairs(cfg)

    def load(self, data) -> tuple[list[Pair], SFTStats]:
        return load_pairs(data, self.template, self.tokenizer)

    def rows_of(self, pairs: list[Pair]) -> list[Pair]:
        return list(pairs)

    def build(self, dims, accum: int) -> None:
        super().build(dims, accum)
        self.pipelined = dims.pp > 1

    def collate(self, groups: list[list[Pair]]) -> list[Batch]:
        """Pipeline parallel: every micro-batch exactly `train.micro_batch` rows (one shape
        for the schedule) and pairs numbered across the step (the schedule re-splits rows;
        `renumber_slots` numbers each piece from 0 again)."""
        rows = self.cfg.train.micro_batch if getattr(self, "pipelined", False) else None
        batches, first = [], 0
        for group in groups:
            batch = pack_pairs(group, self.seq_len, self.pad_id, rows=rows,
                               share_prompts=getattr(self, "share_prompts", False))  # fmt: skip
            if rows is not None:
                batch[SLOT_KEY] = torch.where(batch[SLOT_KEY] >= 0, batch[SLOT_KEY] + 2 * first, -1)
                first += len(group)
            put_ref_logps(batch, group)  # `dpo.ref: precompute`: the pairs carry them
            batches.append(batch)
        return batches

    def collate_budget(self, groups: list[list[Pair]]) -> list[Batch]:
        """`train.micro_batch_tokens`: each group's pairs in one row as wide as their tokens
        (rounded up to the layout's multiple); an empty group is one row of padding."""
        batches = []
        for group in groups:
            width = self.budget_width(sum(self.unit_tokens(p) for p in group))
            batch = pack_pairs(group, width, self.pad_id, rows=1,
                               share_prompts=getattr(self, "share_prompts", False))  # fmt: skip
            put_ref_logps(batch, group)
            batches.append(batch)
        return batches
