"""Blends of datasets and the train/valid/test datasets of a pretraining run.

`build_pretrain_datasets` takes Megatron's `--data-path` spelling (one prefix, or
`["0.3", "a_text_document", "0.7", "b_text_document"]`) and `--split` ("969,30,1"),
cuts every corpus into the same document ranges, and blends them with Megatron's
greedy rule.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.data.gpt_dataset import GPTDataset, load_or_build
from mindspeed_llm.data.indexed import IndexedDataset, bin_path, dataset_exists, idx_path

__all__ = [
    "BlendedDataset",
    "blending_indices",
    "build_pretrain_datasets",
    "parse_data_paths",
    "parse_split",
    "split_document_ranges",
]

SPLIT_NAMES = ("train", "valid", "test")
# Megatron asks each blended corpus for 0.5% more samples than its share.
_BLEND_SURPLUS = 0.005


def parse_split(split: str) -> tuple[float, float, float]:
    """`"969,30,1"` (or `"98/2/0"`, `"1,0"`) -> normalised (train, valid, test) weights."""
    parts = [p for p in re.split(r"[,/\s]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"split {split!r}: expected up to 3 numbers like '969,30,1'") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise ConfigError(f"split {split!r}: expected up to 3 non-negative numbers like '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"split {split!r}: the weights sum to 0")
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_document_ranges(num_documents: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Consecutive `[begin, end)` document ranges, one per split, Megatron's rounding."""
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds[1:] = [b - excess for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def parse_data_paths(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
) -> tuple[list[Path], list[float] | None]:
    """Megatron's data path list -> (prefixes, weights or None when not given).

    Accepts one prefix, a list of prefixes, or `[weight, prefix, weight, prefix, ...]`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    items = [str(p) for p in paths]
    if not items:
        raise ConfigError("no data paths given")
    if len(items) % 2 == 0 and all(_is_number(x) for x in items[0::2]):
        weights = [float(x) for x in items[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"data path weights {weights} must be >= 0 and not all 0")
        return [Path(x) for x in items[1::2]], weights
    return [Path(x) for x in items], None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: (dataset index, sample index within it) per position.

    At each position the dataset whose share so far lags its weight the most gets
    the next sample (the first such dataset on ties), so every prefix of the blend
    follows the weights as closely as integers allow. Deterministic.
    """
    w = [float(x) for x in np.asarray(weights, dtype=np.float64) / np.sum(weights)]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    choices = range(1, len(w))
    for position in range(size):
        t = max(position, 1)
        best, best_error = 0, w[0] * t - counts[0]
        for i in choices:
            error = w[i] * t - counts[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[position] = best
        sample_index[position] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in fixed proportions.

    Args:
        datasets: indexable datasets (e.g. `GPTDataset`s).
        weights: one non-negative weight per dataset (normalised here).
        size: the number of samples of the blend.
        cache_dir: where to cache the blending indices; no cache when None.

    Raises:
        DataError: a dataset has fewer samples than its share of `size`.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        *,
        cache_dir: str | os.PathLike | None = None,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"blend weights {list(weights)} must be >= 0 and not all 0")
        self.datasets = list(datasets)
        self.weights = [float(w) / float(sum(weights)) for w in weights]
        self.size = int(size)
        if cache_dir is None:
            self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        else:
            keys = [getattr(d, "cache_key", repr(d)) for d in self.datasets]
            text = json.dumps({"datasets": keys, "weights": self.weights, "size": self.size})
            key = hashlib.sha256(text.encode()).hexdigest()[:16]
            self.dataset_index, self.dataset_sample_index = load_or_build(
                Path(cache_dir) / f"blend.{key}",
                ("dataset_index", "dataset_sample_index"),
                lambda: blending_indices(self.weights, size),
            )
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, counts, strict=True):
            if count > len(dataset):
                raise DataError(
                    f"{dataset!r} has {len(dataset)} samples, the blend needs {count} of it"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        which = int(self.dataset_index[index])
        return self.datasets[which][int(self.dataset_sample_index[index])]

    def __repr__(self) -> str:
        return f"BlendedDataset(size={self.size}, weights={self.weights}, datasets={self.datasets})"


def build_pretrain_datasets(
    data_paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    split: str,
    seq_len: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | os.PathLike | None = None,
) -> tuple:
    """The (train, valid, test) datasets of a pretraining run.

    Each is a `GPTDataset` (one corpus), a `BlendedDataset` (several), or None when
    its split weight is 0. A requested count of 0 gives one epoch of the split.

    Args:
        data_paths: one prefix, or Megatron's list `[w1, prefix1, w2, prefix2, ...]`
            (without weights, corpora are weighted by their token counts).
        split: train/valid/test document proportions, e.g. "969,30,1".
        seq_len: tokens per sample fed to the model.
        seed: seed of every shuffle.
        num_samples: samples wanted per split.
        cache_dir: where index files go; default next to each corpus.

    Raises:
        DataError: a prefix is missing or a split of a corpus is too small.
    """
    prefixes, weights = parse_data_paths(data_paths)
    for prefix in prefixes:
        if not dataset_exists(prefix):
            missing = [str(p) for p in (idx_path(prefix), bin_path(prefix)) if not p.is_file()]
            raise DataError(f"data path {prefix}: missing {' and '.join(missing)}")
    corpora = [IndexedDataset(p) for p in prefixes]
    if weights is None:
        weights = [float(c.sequence_lengths.sum(dtype=np.int64)) for c in corpora]
    split_weights = parse_split(split)
    ranges = [split_document_ranges(c.num_documents, split_weights) for c in corpora]
    blend_cache = cache_dir if cache_dir is not None else prefixes[0].parent
    results = []
    for s, name in enumerate(SPLIT_NAMES):
        if split_weights[s] == 0:
            results.append(None)
            continue
        wanted = int(num_samples[s])
        parts = []
        for corpus, corpus_ranges, weight in zip(corpora, ranges, weights, strict=True):
            begin, end = corpus_ranges[s]
            if end <= begin:
                raise DataError(
                    f"data path {corpus.prefix}: the {name} split of '{split}' gets no "
                    f"document of {corpus.num_documents}"
                )
            share = wanted
            if len(corpora) > 1 and wanted:
                share = math.ceil(math.ceil(wanted * weight / sum(weights)) * (1 + _BLEND_SURPLUS))
            parts.append(
                GPTDataset(
                    corpus,
                    document_range=(begin, end),
                    seq_len=seq_len,
                    num_samples=share,
                    seed=seed,
                    cache_dir=cache_dir,
                )
            )
        if len(parts) == 1:
            results.append(parts[0])
            continue
        size = wanted or _one_epoch_blend_size(parts, weights)
        results.append(BlendedDataset(parts, weights, size, cache_dir=blend_cache))
    return tuple(results)


def _one_epoch_blend_size(parts: list[GPTDataset], weights: Sequence[float]) -> int:
    """The largest blend no dataset of which repeats a sample."""
    total = sum(weights)
    return int(min((len(p) - 1) * total / w for p, w in zip(parts, weights, strict=True) if w > 0))
