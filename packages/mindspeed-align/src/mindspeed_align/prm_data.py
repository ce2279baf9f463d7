"""Process-reward data: stepwise records -> samples labelled at the end of each step, and the demo.

A record is TRL's stepwise-supervision format `{prompt, completions, labels}` (`steps` is
accepted for `completions`; one boolean label per step), or a `mindspeed preprocess
--handler-name prm` prefix. A sample is the prompt then every step followed by the step
separator (`mindspeed_llm.data.sft.encode_steps`, TRL's PRMTrainer tokenization); its labels are
aligned with the ids (not shifted) and hold 1/0 at the last token of each step's separator,
-100 elsewhere. `PRMData` is SFT's data source over these samples (padded or packed rows).

The demo: the SFT demo's counting questions answered in three steps (the first number, the
second number, the total), each step wrong with probability 0.4.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from mindspeed_align.common import read_units, write_folder
from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import DataError
from mindspeed_llm.data.sft import Sample, SFTStats, encode_steps
from mindspeed_llm.data.sft_records import RAW_SUFFIXES, RecordError, read_records, stepwise_record
from mindspeed_llm.train.sft_data import SFTData

__all__ = ["PRMData", "ensure_prm_demo", "load_steps"]

DEMO_VERSION = "v1"
NUM_TRAIN, NUM_HELDOUT = 3000, 200
WRONG = 0.4
"""Probability that a demo step is wrong."""


def load_steps(data, tokenizer, separator: str) -> tuple[list[Sample], SFTStats]:
    """Every sample of `data.paths`; longer than `data.seq_len`: dropped and counted."""

    def read(path):
        return (
            _raw(path, tokenizer, separator)
            if Path(path).suffix.lower() in RAW_SUFFIXES
            else _prefix(path)
        )

    return read_units(data, read, lambda s: len(s[0]))


def _raw(path, tokenizer, separator: str) -> list[Sample]:
    samples = []
    for where, record in read_records(Path(path), expect="stepwise"):
        try:
            samples.append(encode_steps(tokenizer, *stepwise_record(record), separator=separator))
        except (RecordError, DataError) as err:
            raise DataError(f"{where}: {err}") from None
    return samples


def _prefix(prefix) -> list[Sample]:
    """A `preprocess --handler-name prm` output (its labels are step labels, not shifted)."""
    from mindspeed_llm.data.indexed import IndexedDataset, dataset_exists

    names = {k: f"{prefix}_packed_{k}_document" for k in ("input_ids", "labels")}
    for name in names.values():
        if not dataset_exists(name):
            raise DataError(f"data.paths: {name}.bin/.idx not found (from prefix {prefix}; preprocess with "
                            "--handler-name prm)")  # fmt: skip
    ids, labels = IndexedDataset(names["input_ids"]), IndexedDataset(names["labels"])
    return [
        (np.asarray(ids[i], np.int64), np.asarray(labels[i], np.int64)) for i in range(len(ids))
    ]


class PRMData(SFTData):
    """SFT's data source over stepwise samples (see the module docstring)."""

    def use_demo(self, cfg) -> None:
        if is_rank0():
            ensure_prm_demo()
        if dist.is_initialized():
            dist.barrier()
        demo = ensure_prm_demo()
        cfg.data.paths = [str(demo.train)]
        cfg.data.tokenizer = cfg.data.tokenizer or demo.tokenizer

    def load(self, data) -> tuple[list[Sample], SFTStats]:
        return load_steps(data, self.tokenizer, self.cfg.prm.step_separator)


# -- the demo -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PRMDemo:
    train: Path
    heldout: Path
    tokenizer: Path


def _steps(rng: random.Random) -> dict:
    """A counting question of the SFT demo answered in three steps, each maybe wrong."""
    from mindspeed_llm.demo import NAMES, NUMBER_WORDS, THINGS

    a, b = rng.sample(NAMES, 2)
    thing, x, y = rng.choice(THINGS), rng.randint(0, 5), rng.randint(0, 5)
    prompt = (f"{a} had {NUMBER_WORDS[x]} {thing} and {b} had {NUMBER_WORDS[y]}. "
              f"how many {thing} did they have together?")  # fmt: skip
    right = [rng.random() >= WRONG for _ in range(3)]
    shown = [v if ok else rng.choice([w for w in range(hi + 1) if w != v])
             for v, ok, hi in zip((x, y, x + y), right, (5, 5, 10), strict=True)]  # fmt: skip
    steps = [f"{a} had {NUMBER_WORDS[shown[0]]} {thing}.", f"{b} had {NUMBER_WORDS[shown[1]]}.",
             f"together they had {NUMBER_WORDS[shown[2]]} {thing}."]  # fmt: skip
    return {"prompt": prompt, "completions": steps, "labels": right}


def ensure_prm_demo(root: Path | None = None) -> PRMDemo:
    """The demo's files, built on first use (call on one rank)."""
    from mindspeed_llm.demo import cache_root
    from mindspeed_llm.sft_demo import ensure_sft_demo

    root = root or cache_root()
    sft = ensure_sft_demo(root)
    folder = root / f"prm-demo-{DEMO_VERSION}"
    demo = PRMDemo(folder / "train.jsonl", folder / "heldout.jsonl", sft.tokenizer)
    if demo.heldout.is_file():
        return demo
    rng = random.Random(5)
    train = [_steps(rng) for _ in range(NUM_TRAIN)]
    seen = {r["prompt"] for r in train}
    heldout = [r for r in (_steps(rng) for _ in range(8 * NUM_HELDOUT)) if r["prompt"] not in seen]
    write_folder(folder, {"train.jsonl": train, "heldout.jsonl": heldout[:NUM_HELDOUT]})
    return demo
