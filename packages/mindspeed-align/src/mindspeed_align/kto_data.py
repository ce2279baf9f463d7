"""KTO data: unpaired records -> (sample, desirable) examples -> micro-batches with KL rows.

A record is TRL's unpaired format `{prompt, completion, label}` (prompt and completion strings
or messages; `label` true for a desirable completion), with the spellings
`mindspeed_llm.data.sft_records.unpaired_messages` reads (alpaca's `instruction`/`input`/`output`,
LLaMA-Factory's `kto_tag`), or a `mindspeed preprocess --handler-name kto` prefix. Each example
is encoded with the run's chat template as an SFT sample (only the completion supervised).

KTO's reference point is estimated from mismatched pairs, as TRL builds them: within each
micro-batch the completions are rotated by one, `(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})`.
An example and its mismatched sequence ride in one packed row as the two sides of a "pair"
(`logps.pack_pairs`): slot 2i is example i, slot 2i + 1 its KL sequence. The batch also holds
`kto_label` (one bool per example).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mindspeed_align.common import read_units
from mindspeed_align.logps import pack_pairs
from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.data.collate import IGNORE_INDEX, Batch
from mindspeed_llm.data.sft import Sample, SFTStats, encode_sample, read_prefix
from mindspeed_llm.data.sft_records import (
    RAW_SUFFIXES,
    RecordError,
    read_records,
    unpaired_messages,
)
from mindspeed_llm.train.sft_data import SFTData

__all__ = [
    "LABEL_KEY",
    "KTOData",
    "KTOExample",
    "encode_example",
    "kto_batch",
    "load_examples",
    "splice",
]

KTOExample = tuple[Sample, bool]
"""An encoded example and whether its completion is desirable."""
LABEL_KEY = "kto_label"
"""The batch key of the per-example labels."""


def encode_example(template, tokenizer, record, where: str) -> KTOExample:
    """A record's sample and label. Raises DataError naming `where` (file:line)."""
    try:
        messages, desirable = unpaired_messages(record)
        return encode_sample(template, tokenizer, messages), desirable
    except (RecordError, DataError) as err:
        raise DataError(f"{where}: {err}") from None


def _prompt_length(sample: Sample) -> int:
    """Tokens before the completion (labels are shifted: the first label is at its end)."""
    return int(np.argmax(sample[1] != IGNORE_INDEX)) + 1


def splice(prompt_of: Sample, completion_of: Sample) -> Sample:
    """The prompt of one sample followed by the completion (and its supervision) of another."""
    p, c = _prompt_length(prompt_of), _prompt_length(completion_of)
    ids = np.concatenate([prompt_of[0][:p], completion_of[0][c:]])
    labels = np.concatenate([np.full(p - 1, IGNORE_INDEX, np.int64), completion_of[1][c - 1 :]])
    return ids, labels


def kto_batch(examples: list[KTOExample], seq_len: int, pad_id: int) -> Batch:
    """Examples with their mismatched KL sequences (completions rotated by one) packed in rows
    at least `seq_len` wide, plus `kto_label`."""
    pairs = [(s, splice(s, examples[i - 1][0])) for i, (s, _) in enumerate(examples)]
    width = max(seq_len, *(len(a[0]) + len(b[0]) for a, b in pairs))
    batch = pack_pairs(pairs, width, pad_id)
    batch[LABEL_KEY] = torch.tensor([d for _, d in examples], dtype=torch.bool)
    return batch


def load_examples(data, template, tokenizer) -> tuple[list[KTOExample], SFTStats]:
    """Every example of `data.paths` (raw files or `kto` preprocess prefixes); examples longer
    than half `data.seq_len` (the row also holds a KL sequence) are dropped and counted.

    Raises:
        DataError: a bad record, or data with only one label class (naming the files).
    """

    def read(path):
        return (
            _raw(path, template, tokenizer)
            if Path(path).suffix.lower() in RAW_SUFFIXES
            else _prefix(path)
        )

    examples, stats = read_units(data, read, lambda e: 2 * len(e[0][0]))
    classes = {d for _, d in examples}
    if len(classes) == 1:
        raise DataError(f"{', '.join(map(str, data.paths))}: every example is labelled {classes.pop()}; KTO needs "
                        f"desirable (label true) and undesirable (label false) examples ({stats.line()})")  # fmt: skip
    return examples, stats


def _raw(path, template, tokenizer) -> list[KTOExample]:
    return [
        encode_example(template, tokenizer, record, where)
        for where, record in read_records(Path(path), expect="unpaired")
    ]


def _prefix(prefix) -> list[KTOExample]:
    """A `mindspeed preprocess --handler-name kto` output: SFT samples plus `kto_label`."""
    from mindspeed_llm.data.indexed import IndexedDataset, dataset_exists

    samples, _ = read_prefix(prefix)
    name = f"{prefix}_packed_{LABEL_KEY}_document"
    if not dataset_exists(name):
        raise DataError(f"data.paths: {name}.bin/.idx not found (from prefix {prefix}; preprocess with "
                        "--handler-name kto)")  # fmt: skip
    labels = IndexedDataset(name)
    if len(labels) != len(samples):
        raise DataError(
            f"{prefix}: {len(samples)} samples but {len(labels)} labels (a packed prefix?)"
        )
    return [(s, bool(labels[i][0])) for i, s in enumerate(samples)]


class KTOData(SFTData):
    """SFT's data source with unpaired examples as units (see the module docstring)."""

    def use_demo(self, cfg) -> None:
        use_demo_examples(cfg)

    def load(self, data) -> tuple[list[KTOExample], SFTStats]:
        return load_examples(data, self.template, self.tokenizer)

    def rows_of(self, examples: list[KTOExample]) -> list[KTOExample]:
        return list(examples)

    def collate(self, groups: list[list[KTOExample]]) -> list[Batch]:
        return [kto_batch(g, self.seq_len, self.pad_id) for g in groups]

    def unit_tokens(self, unit: KTOExample) -> int:
        return len(unit[0][0])

    def _check_budget(self) -> None:
        if self.budget is not None:
            raise ConfigError(
                f"train.micro_batch_tokens={self.budget}: KTO's KL term pairs each example with "
                "its neighbour in the micro-batch, so micro-batches are fixed rows; use "
                "train.micro_batch"
            )


def unpaired_demo(root: Path | None = None) -> Path:
    """The DPO demo's training pairs as unpaired records (chosen: label true, rejected: label
    false), written once next to them (call on one rank)."""
    from mindspeed_align.dpo_demo import ensure_dpo_demo

    demo = ensure_dpo_demo(root)
    out = demo.train.parent / "kto-train.jsonl"
    if out.is_file():
        return out
    rows = []
    for line in demo.train.read_text().splitlines():
        pair = json.loads(line)
        rows += [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                 {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]  # fmt: skip
    fd, tmp = tempfile.mkstemp(prefix=".kto-train-", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)  # all or nothing
    return out


def use_demo_examples(cfg) -> Path:
    """Point `cfg.data` at the demo's unpaired records (built on rank 0 first)."""
    from mindspeed_align.dpo_demo import ensure_dpo_demo

    if is_rank0():
        unpaired_demo()
    if dist.is_initialized():
        dist.barrier()
    demo = ensure_dpo_demo()
    cfg.data.paths = [str(unpaired_demo())]
    cfg.data.tokenizer = cfg.data.tokenizer or demo.tokenizer
    cfg.data.chat_template = cfg.data.chat_template or str(demo.template)
    return cfg.data.paths[0]
