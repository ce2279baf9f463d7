"""SFT samples: instruction records -> (input_ids, labels), fitted to a length, padded or
packed into rows of the one batch contract.

A sample is two equally long int arrays: `ids` (the whole rendered conversation) and
`labels`, where `labels[t]` is the token to predict after `ids[:t + 1]` (the batch
contract's shift) and -100 wherever that token is not part of an assistant reply (and at
the last position). So the loss of a sample equals transformers' / TRL's completion-only
loss on the same ids, whose labels are shifted inside the model.

Rows: `pad` puts one sample per row; `pack` fills rows of `seq_len` tokens with samples,
best fit decreasing. Either way each sample is one document of `cu_seqlens` with its own
positions from 0, and the padding at a row's end is one more document with no labels, so
a sample's loss and gradients are the same in both modes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mindspeed_core.errors import DataError
from mindspeed_llm.chat_template import ChatTemplate, TemplateDefect, TemplateRefusal, encode_chat
from mindspeed_llm.data.collate import IGNORE_INDEX, Batch
from mindspeed_llm.data.sft_records import (
    KIND_COMMANDS,
    RECORD_FORMATS,
    RecordError,
    detect_record_format,
    merge_map_keys,
    read_records,
    record_messages,
    record_tools,
)

__all__ = [
    "SFTStats",
    "Sample",
    "collate_rows",
    "encode_sample",
    "fit_samples",
    "pack_rows",
    "read_prefix",
    "tokenize_file",
]

logger = logging.getLogger("mindspeed.sft")

Sample = tuple[np.ndarray, np.ndarray]
"""(ids, labels), int64 arrays of one length; labels already shifted (see module doc)."""
CACHE_VERSION = "v1"


@dataclass
class SFTStats:
    """What reading the data kept and left out."""

    records: int = 0
    samples: int = 0
    no_reply: int = 0
    """Records without an assistant reply to learn from (skipped)."""
    refused: int = 0
    """Records the chat template raised on (skipped)."""
    refusal: str = ""
    """The template's first error."""
    bad: int = 0
    """Records with a missing or mistyped field (skipped)."""
    truncated: int = 0
    dropped: int = 0
    """Samples longer than seq_len left out (overflow=drop, or nothing supervised left)."""

    def add(self, other: SFTStats) -> None:
        for key, value in asdict(other).items():
            if key == "refusal":
                self.refusal = self.refusal or value
            else:
                setattr(self, key, getattr(self, key) + value)

    def line(self) -> str:
        refused = f" {self.refused} refused by the chat template ({self.refusal})," if self.refused else ""
        return (
            f"{self.samples} samples from {self.records} records; skipped{refused} {self.no_reply} "
            f"without an assistant reply and {self.bad} bad; {self.truncated} truncated and "
            f"{self.dropped} dropped as longer than seq_len"
        )


def encode_sample(
    template: ChatTemplate,
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: list | None = None,
) -> Sample:
    """A conversation's ids and shifted labels: only assistant replies are supervised
    (every one the template renders as generated), never system, user or tool turns.

    Raises:
        DataError: no assistant reply to learn from.
    """
    if any(m.get("tool_calls") for m in messages):
        _check_tool_calls(template, messages, tools)
    ids, aligned = encode_chat(template, tokenizer, messages, tools=tools)
    labels = aligned[1:] + [IGNORE_INDEX]
    return np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def _check_tool_calls(template: ChatTemplate, messages, tools) -> None:
    """Every tool call of the conversation shows in its rendering: a template that knows no
    tool calls would drop them and train on an empty reply."""
    try:
        text = template.render(messages, tools=tools)
    except TemplateRefusal as err:
        raise TemplateRefusal(f"{err} (on a conversation with tool calls: does the template "
                              "render them?)") from None  # fmt: skip
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            if name not in text:
                raise TemplateRefusal(
                    f"chat template {template.origin} does not render tool calls: the call of "
                    f"{name!r} in message {i} would be lost (give a template that does, e.g. the "
                    "model folder's own)"
                )


def encode_steps(tokenizer, prompt: str, steps: Sequence[str], labels: Sequence[bool],
                 separator: str = "\n") -> Sample:  # fmt: skip
    """A process-supervision sample, as TRL's PRMTrainer tokenizes it: BOS (when the
    tokenizer has one), the prompt, then each step followed by `separator`; the labels
    (aligned with the ids, not shifted) hold the step's label (1 right, 0 wrong) at the last
    token of its separator and -100 everywhere else."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    ids = bos + tokenizer.encode(prompt, add_bos=False)
    out = [IGNORE_INDEX] * len(ids)
    sep = tokenizer.encode(separator, add_bos=False)
    if not sep:
        raise DataError(f"the step separator {separator!r} encodes to no token")
    for step, label in zip(steps, labels, strict=True):
        chunk = tokenizer.encode(step, add_bos=False) + sep
        ids += chunk
        out += [IGNORE_INDEX] * (len(chunk) - 1) + [int(label)]
    return np.asarray(ids, dtype=np.int64), np.asarray(out, dtype=np.int64)


def _tokenize_records(path, handler, template, tokenizer, strict) -> tuple[list[Sample], SFTStats]:
    stats, samples = SFTStats(), []
    fmt, keys = (None, None) if handler == "auto" else (handler, merge_map_keys(handler))
    for where, record in read_records(path):
        stats.records += 1
        if handler == "auto":
            found, why = detect_record_format(record)
            if fmt is None:
                fmt, keys = _auto_format(found, why, where, record), merge_map_keys(found)
                logger.info("%s: data.handler auto: %s records (%s)", path, fmt, why)
            elif found is not None and found != fmt:
                raise DataError(f"{where}: a {found} record ({why}) in a file whose first record is "
                                f"{fmt}: data.handler auto reads one format per file")  # fmt: skip
        try:
            messages = record_messages(record, fmt, keys)
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError("the conversation has no assistant reply to train on")
            samples.append(encode_sample(template, tokenizer, messages, record_tools(record, keys)))
        except TemplateDefect as err:  # the template cannot run at all: not a record to skip
            raise DataError(f"{where}: {err}") from None
        except DataError as err:
            if strict:
                raise DataError(f"{where}: {err} (data.strict=true)") from None
            if isinstance(err, RecordError):
                stats.bad += 1
            elif isinstance(err, TemplateRefusal):
                stats.refused += 1
                stats.refusal = stats.refusal or f"{where}: {err}"
            else:
                stats.no_reply += 1
            if stats.bad + stats.no_reply + stats.refused <= 3:
                logger.warning("%s: skipped: %s", where, err)
    stats.samples = len(samples)
    return samples, stats


def _auto_format(found: str | None, why: str, where: str, record) -> str:
    """The instruction format of a file from its first record, or a DataError naming it."""
    seen = sorted(record) if isinstance(record, dict) else type(record).__name__
    if found is None:
        raise DataError(f"{where}: data.handler auto cannot tell the record's format ({why}: "
                        f"{seen}); set data.handler to one of {', '.join(RECORD_FORMATS)}")  # fmt: skip
    if found not in RECORD_FORMATS:
        raise DataError(f"{where}: {found} records ({why}) are not instruction data: train them "
                        f"with `mindspeed {KIND_COMMANDS[found]}`")  # fmt: skip
    return found


def tokenize_file(
    path: str | os.PathLike,
    handler: str,
    template: ChatTemplate,
    tokenizer,
    *,
    strict: bool = False,
    cache_dir: Path | None = None,
) -> tuple[list[Sample], SFTStats]:
    """The samples of a raw .json/.jsonl/.parquet file, tokenised once and cached under
    `cache_dir` (keyed by the file's path, size and time, the handler, the template and
    the tokenizer); None: no cache."""
    if not Path(path).is_file():
        raise DataError(f"data.paths: {path} does not exist")
    if cache_dir is None:
        return _tokenize_records(path, handler, template, tokenizer, strict)
    cached = Path(cache_dir) / f"{_cache_key(path, handler, template, tokenizer, strict)}.npz"
    if cached.is_file():
        loaded = _load_cache(cached)
        if loaded is not None:
            return loaded
    samples, stats = _tokenize_records(path, handler, template, tokenizer, strict)
    _save_cache(cached, samples, stats)
    return samples, stats


def _cache_key(path, handler, template, tokenizer, strict) -> str:
    p = Path(path).resolve()
    st = p.stat()
    tok = Path(str(getattr(tokenizer, "path", ""))).resolve()
    tok_stamp = tok.stat().st_mtime_ns if tok.exists() else 0
    parts = [CACHE_VERSION, str(p), st.st_size, st.st_mtime_ns, handler, template.source,
             json.dumps(dict(template.special_tokens), sort_keys=True), str(tok), tok_stamp,
             strict]  # fmt: skip
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def _save_cache(path: Path, samples: list[Sample], stats: SFTStats) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray([len(ids) for ids, _ in samples], dtype=np.int64)
    flat = lambda k: np.concatenate([s[k] for s in samples]) if samples else np.zeros(0, np.int64)  # noqa: E731
    fd, tmp = tempfile.mkstemp(suffix=".npz", dir=path.parent)
    os.close(fd)
    try:
        np.savez(tmp, ids=flat(0), labels=flat(1), lengths=lengths,
                 stats=np.asarray(json.dumps(asdict(stats))))  # fmt: skip
        os.replace(tmp, path)  # all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_cache(path: Path) -> tuple[list[Sample], SFTStats] | None:
    """The cached samples, or None (with one warning) when the file cannot be read whole and
    consistent: the caller tokenises again. np.load checks each member's CRC-32."""
    try:
        with np.load(path, allow_pickle=False) as z:
            lengths, ids, labels = z["lengths"], z["ids"], z["labels"]
            stats = SFTStats(**json.loads(str(z["stats"])))
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        if ids.shape != labels.shape or bounds[-1] != len(ids) or (lengths < 0).any():
            raise ValueError("its arrays do not agree")
    except Exception as err:  # zip, CRC, key, JSON or shape errors: any unreadable cache
        logger.warning("tokenising again: the cache %s cannot be read (%s: %s)", path,
                       type(err).__name__, err)  # fmt: skip
        return None
    samples = [(ids[a:b], labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return samples, stats


def read_prefix(prefix: str | os.PathLike) -> tuple[list[Sample], SFTStats]:
    """The samples of `mindspeed preprocess` (or MindSpeed-LLM) instruction outputs:
    `{prefix}_packed_{input_ids,labels,attention_mask}_document`. Labels there are
    aligned with the ids (MindSpeed-LLM's convention) and are shifted here; rows packed
    with `--neat-pack` (attention_mask = sample number) are split into their samples."""
    from mindspeed_llm.data.indexed import IndexedDataset, dataset_exists

    names = {k: f"{prefix}_packed_{k}_document" for k in ("input_ids", "labels", "attention_mask")}
    for key in ("input_ids", "labels"):
        if not dataset_exists(names[key]):
            raise DataError(f"data.paths: {names[key]}.bin/.idx not found (from prefix {prefix})")
    ids_ds, labels_ds = IndexedDataset(names["input_ids"]), IndexedDataset(names["labels"])
    mask_ds = IndexedDataset(names["attention_mask"]) if dataset_exists(names["attention_mask"]) else None
    samples = []
    for i in range(len(ids_ds)):
        ids, labels = np.asarray(ids_ds[i], np.int64), np.asarray(labels_ds[i], np.int64)
        mask = np.asarray(mask_ds[i]) if mask_ds is not None else np.ones_like(ids)
        for value in sorted(set(mask.tolist()) - {0}):
            keep = mask == value
            seg_ids, seg_labels = ids[keep], labels[keep]
            samples.append((seg_ids, np.concatenate([seg_labels[1:], [IGNORE_INDEX]])))
    return samples, SFTStats(records=len(ids_ds), samples=len(samples))


def fit_samples(
    samples: Iterable[Sample], seq_len: int, overflow: str, stats: SFTStats
) -> list[Sample]:
    """Samples of at most `seq_len` tokens: longer ones cut (`truncate`; dropped when no
    supervised token is left) or dropped (`drop`), counted in `stats`."""
    kept = []
    for ids, labels in samples:
        if len(ids) > seq_len:
            if overflow == "drop" or not (labels[: seq_len - 1] != IGNORE_INDEX).any():
                stats.dropped += 1
                continue
            stats.truncated += 1
            ids, labels = ids[:seq_len], np.concatenate([labels[: seq_len - 1], [IGNORE_INDEX]])
        kept.append((ids, labels))
    stats.samples = len(kept)
    return kept


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most `seq_len` tokens, best fit decreasing:
    the longest sample first, each into the row it fills most (TRL's and LLaMA-Factory's
    strategy; few rows, little padding). Rows keep their samples in index order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            room, row = seq_len - n, len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    return [sorted(r) for r in rows]


def collate_rows(rows: Sequence[Sequence[Sample]], width: int, pad_id: int) -> Batch:
    """Rows of samples -> a batch `width` tokens wide: every sample a document with
    positions from 0, the padding after them one more document with labels -100."""
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(rows):
        start = 0
        for ids, lab in row:
            end = start + len(ids)
            input_ids[r, start:end] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            labels[r, start:end] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
            position_ids[r, start:end] = torch.arange(len(ids))
            bounds.append(r * width + end)
            start = end
        if start > width:
            raise ValueError(f"row {r} holds {start} tokens, more than {width}")
        position_ids[r, start:] = torch.arange(width - start)
        if start < width:
            bounds.append((r + 1) * width)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
    }
