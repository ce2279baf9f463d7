"""The preprocessing pipeline: read records, tokenize them in workers, write indexed datasets.

Outputs are Megatron `.bin`/`.idx` pairs named as MindSpeed-LLM names them:
`<prefix>_<key>_document` for pretraining (one pair per json key) and
`<prefix>_packed_<key>_document` for instruction and pairwise data. Every pair is written
to temporary files and renamed only when all records are done, so a failure (a full disk
included) leaves nothing behind; temporaries of a run that was killed are removed by the
next run writing the same outputs. Worker processes die with the main process.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mindspeed_core.errors import ConfigError, DataError, disk_full_error, is_disk_full
from mindspeed_core.files import owned_temp_prefix, remove_stale_temps
from mindspeed_core.lifeline import pool_initializer, spawn_context
from mindspeed_tools.preprocess.handlers import output_keys
from mindspeed_tools.preprocess.sources import count_records, find_inputs, read_items
from mindspeed_tools.preprocess.worker import (
    HandlerSpec,
    Result,
    init_worker,
    process_chunk,
    process_item,
)

__all__ = ["PreprocessConfig", "Summary", "output_prefixes", "preprocess"]

logger = logging.getLogger("mindspeed.preprocess")

HF_CACHE_NAME = "mindspeed-hf"
CHUNK_SIZE = 64
MAX_REPORTED = 20  # bad records reported one by one; the rest only counted
IGNORE_INDEX = -100
# Output keys that shadow another key's tokens: not counted in the summary's tokens.
_NOT_TOKENS = frozenset(
    {"attention_mask", "labels", "chosen_labels", "rejected_labels", "kto_label"}
)


@dataclass(kw_only=True)
class PreprocessConfig:
    """Everything `mindspeed preprocess` does, as data."""

    input: str
    """A data file, a folder of them or a glob (json, jsonl, parquet, csv, txt)."""
    output_prefix: str
    """Output path prefix; `_text_document` (pretrain) or `_packed_...` is appended."""
    handler: HandlerSpec
    """The record handler and its tokenizer."""
    workers: int = 1
    """Tokenizer processes; the output is the same for any number."""
    seq_length: int | None = None
    """Instruction/pairwise samples this long or longer are dropped (or packed into)."""
    pack: bool = False
    """Pack instruction samples into rows of exactly `seq_length` tokens."""
    neat_pack: bool = False
    """With `pack`: attention_mask holds the sample number 1..k (0 on padding)."""
    strict: bool = False
    """Stop at the first bad record instead of skipping it."""
    max_samples: int | None = None
    """Read at most this many records."""
    progress: bool | None = None
    """Show a progress bar (None: when stderr is a terminal)."""

    def __post_init__(self):
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.seq_length is not None and self.seq_length < 2:
            raise ConfigError(f"--seq-length must be at least 2, got {self.seq_length}")
        if self.handler.name == "pretrain" and (self.seq_length or self.pack):
            raise ConfigError(
                "--seq-length and --pack apply to instruction and pairwise handlers; "
                "pretraining documents are cut into samples at training time"
            )
        if self.pack and (
            self.seq_length is None or self.handler.name in ("pairwise", "kto", "prm")
        ):
            raise ConfigError("--pack needs --seq-length and an instruction handler")
        if self.neat_pack and not self.pack:
            raise ConfigError("--neat-pack requires --pack")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"--max-samples must be at least 1, got {self.max_samples}")


@dataclass
class Summary:
    """What a run read and wrote."""

    records: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    empty: int = 0
    too_long: int = 0
    outputs: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.records} records -> {self.documents} documents, {self.tokens} tokens; "
            f"skipped {self.skipped} bad, {self.empty} empty, {self.too_long} too long"
        )


def output_prefixes(cfg: PreprocessConfig) -> dict[str, Path]:
    """{key: dataset prefix} of the files a run writes."""
    prefix = cfg.output_prefix if cfg.handler.name == "pretrain" else f"{cfg.output_prefix}_packed"
    keys = output_keys(cfg.handler.name, cfg.handler.json_keys)
    return {key: Path(f"{prefix}_{key}_document") for key in keys}


def preprocess(cfg: PreprocessConfig) -> Summary:
    """Run preprocessing; returns the summary. Raises DataError/ConfigError on bad input."""
    files = find_inputs(cfg.input)
    handler = cfg.handler.build()  # fails early on a bad tokenizer or template
    if cfg.handler.append_eod and handler.tokenizer.eod_id is None:
        raise ConfigError(f"--append-eod: tokenizer {handler.tokenizer.path} has no EOS token")
    if cfg.handler.add_bos and handler.tokenizer.bos_id is None:
        raise ConfigError(f"--add-bos: tokenizer {handler.tokenizer.path} has no BOS token")
    if handler.template is not None and handler.template.is_fallback:
        logger.warning(
            "no chat template next to %s; using the built-in ChatML template",
            cfg.handler.chat_template or cfg.handler.tokenizer,
        )
    targets = output_prefixes(cfg)
    first = next(iter(targets.values()))
    created = _missing_parents(first)
    try:
        summary = _write(cfg, files, handler, targets)
    except BaseException as err:
        for folder in reversed(created):  # only folders this run made, and only if empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        if is_disk_full(err):  # the writers removed their temporaries already
            needed = sum(f.stat().st_size for f in files if f.is_file())  # ~ the input's size
            raise disk_full_error(f"{first}.bin", needed) from None
        raise
    summary.outputs = [str(p) for p in targets.values()]
    return summary


def _write(cfg: PreprocessConfig, files: list[Path], handler, targets: dict) -> Summary:
    """Every dataset in `targets`, all finalized together at the end or none at all."""
    from mindspeed_llm.data.indexed import IndexedDatasetWriter, best_dtype  # imports torch

    if cfg.handler.name == "pretrain":
        dtype = best_dtype(handler.tokenizer.vocab_size)  # Megatron's rule
    else:
        dtype = np.int32  # labels hold -100 (MindSpeed-LLM keeps int32 for all keys)
    summary = Summary()
    with contextlib.ExitStack() as stack:
        writers = {
            key: stack.enter_context(IndexedDatasetWriter(prefix, dtype))
            for key, prefix in targets.items()
        }
        temp_root = Path(tempfile.gettempdir())
        remove_stale_temps(temp_root, HF_CACHE_NAME)  # a killed run's datasets cache
        cache_dir = stack.enter_context(
            tempfile.TemporaryDirectory(prefix=owned_temp_prefix(HF_CACHE_NAME))
        )
        items = itertools.islice(read_items(files, cache_dir), cfg.max_samples)
        total = count_records(files) if _bar_off(cfg) is not True else None
        if total is not None and cfg.max_samples:
            total = min(total, cfg.max_samples)
        results = _results(cfg, handler, items, stack)
        samples = _consume(cfg, results, writers, summary, total)
        if cfg.pack:
            _write_packs(cfg, samples, writers, handler.tokenizer.pad_id or 0)
        if summary.documents == 0:
            raise DataError(f"no usable records in {cfg.input} ({summary.line()})")
    return summary


def _missing_parents(prefix: Path) -> list[Path]:
    missing = []
    folder = prefix.absolute().parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _results(cfg, handler, items, stack: contextlib.ExitStack) -> Iterator[Result]:
    """Results in input order, from this process or from a pool of workers."""
    if cfg.workers == 1:
        yield from (process_item(handler, item) for item in items)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn: workers start clean (no forked tokenizer threads). They die with this process,
    # armed before they import the worker module (mindspeed_core.lifeline says why).
    # A worker that dies (e.g. killed for memory) fails the run instead of hanging it.
    pool = ProcessPoolExecutor(
        cfg.workers,
        mp_context=spawn_context(),
        initializer=pool_initializer,
        initargs=(os.getpid(), f"{init_worker.__module__}:init_worker", asdict(cfg.handler)),
    )
    stack.callback(pool.shutdown, wait=True, cancel_futures=True)
    pending: collections.deque = collections.deque()
    try:
        for chunk in _chunks(items, CHUNK_SIZE):
            pending.append(pool.submit(process_chunk, chunk))
            if len(pending) >= 4 * cfg.workers:  # bounded: never read the whole input ahead
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool as err:
        raise DataError(f"a preprocessing worker died ({err}); try fewer --workers") from None


def _consume(cfg, results: Iterator[Result], writers, summary: Summary, total=None) -> list[dict]:
    """Write (or, when packing, collect) every usable result; count the rest."""
    from tqdm import tqdm

    kept = []
    bar = tqdm(
        results,
        desc="preprocess",
        unit=" records",
        total=total,
        disable=_bar_off(cfg),
        file=sys.stderr,
    )
    for status, where, payload in bar:
        summary.records += 1
        if status == "bad":
            if cfg.strict:
                raise DataError(f"{where}: {payload} (--strict)")
            summary.skipped += 1
            if summary.skipped <= MAX_REPORTED:
                logger.warning("skipped %s: %s", where, payload)
            elif summary.skipped == MAX_REPORTED + 1:
                logger.warning("more bad records: only counted from here on")
            continue
        if status == "empty":
            summary.empty += 1
            continue
        longest = max(len(ids) for ids in payload.values())
        if cfg.seq_length is not None and longest >= cfg.seq_length and not cfg.neat_pack:
            summary.too_long += 1  # MindSpeed-LLM drops them too
            continue
        summary.documents += 1
        if cfg.pack:
            kept.append({k: v[: cfg.seq_length - 1] for k, v in payload.items()})
            summary.tokens += min(longest, cfg.seq_length - 1)
            continue
        for key, ids in payload.items():
            if ids.size:  # an empty json key stays out of its dataset, as in MindSpeed-LLM
                writers[key].add_document(ids)
                if key not in _NOT_TOKENS:
                    summary.tokens += int(ids.size)
    return kept


def _bar_off(cfg) -> bool | None:
    return None if cfg.progress is None else not cfg.progress


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of lengths, each summing to at most `capacity`: LLaMA-Factory's greedy fill.

    Fill each bin with the longest remaining length that still fits, until none does.
    """
    import bisect

    remaining = sorted(lengths)
    bins = []
    while remaining:
        room, current = capacity, []
        while (index := bisect.bisect(remaining, room)) > 0:
            length = remaining.pop(index - 1)
            room -= length
            current.append(length)
        bins.append(current)
    return bins


def _write_packs(cfg, samples: list[dict], writers, pad_id: int) -> None:
    """Rows of exactly `seq_length` tokens, each a few whole samples plus padding."""
    by_length: dict[int, list[int]] = collections.defaultdict(list)
    for index, sample in enumerate(samples):
        by_length[len(sample["input_ids"])].append(index)
    pad = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0 if cfg.neat_pack else 1}
    for lengths in greedy_knapsack([len(s["input_ids"]) for s in samples], cfg.seq_length - 1):
        row: dict[str, list[Any]] = {key: [] for key in writers}
        for number, length in enumerate(lengths, start=1):
            sample = samples[by_length[length].pop()]
            for key in writers:
                if key == "attention_mask" and cfg.neat_pack:
                    row[key].append(np.full(length, number, dtype=np.int32))
                else:
                    row[key].append(sample[key])
        for key, parts in row.items():
            ids = np.concatenate(parts) if parts else np.empty(0, np.int32)
            ids = np.concatenate([ids, np.full(cfg.seq_length - ids.size, pad[key], np.int32)])
            writers[key].add_document(ids)
