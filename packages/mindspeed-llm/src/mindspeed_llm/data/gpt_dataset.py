"""GPT pretraining samples over one indexed dataset, Megatron's way.

The documents of a split are concatenated (in a shuffled order, repeated for as
many epochs as the requested number of samples needs) and cut into samples of
`seq_len + 1` tokens, the extra token feeding the shifted labels; consecutive
samples share one token. Three index arrays describe it, as in Megatron-Core:

- `doc_idx` (int32): the document ids in reading order, all epochs;
- `sample_idx` (int64, (num_samples + 1, 2)): (position in doc_idx, token offset)
  where each sample starts; a sample ends where the next one starts, plus one token;
- `shuffle_idx`: the order in which samples are served.

They are built with one `numpy.random.RandomState(seed)`, exactly as Megatron does
(same documents, same seed, same samples), vectorised, and cached as `.npy` files
whose names hash the parameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from mindspeed_core.errors import DataError
from mindspeed_llm.data.indexed import IndexedDataset

__all__ = ["GPTDataset", "build_gpt_indices"]

logger = logging.getLogger(__name__)

# Bump when the index layout or algorithm changes: old caches then stop matching.
_INDEX_VERSION = 1
# Megatron shuffles a last epoch apart when it would be used less than this much.
_SEPARATE_FINAL_EPOCH_BELOW = 0.80


def build_gpt_indices(
    document_lengths: np.ndarray,
    documents: np.ndarray,
    *,
    seq_len: int,
    num_samples: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (doc_idx, sample_idx, shuffle_idx) of Megatron's GPTDataset.

    Args:
        document_lengths: tokens per document, indexed by document id.
        documents: the document ids of the split.
        seq_len: tokens per sample, not counting the extra label token.
        num_samples: samples wanted; 0 means one epoch.
        seed: seed of the shuffles.
    """
    documents = np.asarray(documents, dtype=np.int32)
    tokens_per_epoch = int(document_lengths[documents].sum())
    tokens_wanted = num_samples * seq_len + 1
    num_epochs = max(1, -(-tokens_wanted // tokens_per_epoch)) if num_samples else 1
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
    separate_final_epoch = False
    if num_epochs > 1:
        samples_per_epoch = (tokens_per_epoch - 1) // seq_len
        from_final_epoch = num_samples - samples_before_last
        separate_final_epoch = from_final_epoch < int(
            _SEPARATE_FINAL_EPOCH_BELOW * samples_per_epoch
        )

    rng = np.random.RandomState(seed)
    if separate_final_epoch:
        doc_idx = np.concatenate(
            [_document_index(documents, num_epochs - 1, rng), _document_index(documents, 1, rng)]
        )
    else:
        doc_idx = _document_index(documents, num_epochs, rng)
    sample_idx = _sample_index(document_lengths, doc_idx, seq_len, num_epochs * tokens_per_epoch)
    num_built = sample_idx.shape[0] - 1
    first_range = samples_before_last if separate_final_epoch else num_built
    shuffle_idx = _shuffle_index(first_range, num_built, rng)
    return doc_idx, sample_idx, shuffle_idx


def _document_index(documents: np.ndarray, num_epochs: int, rng) -> np.ndarray:
    doc_idx = np.tile(documents, num_epochs).astype(np.int32)
    rng.shuffle(doc_idx)
    return doc_idx


def _sample_index(
    document_lengths: np.ndarray, doc_idx: np.ndarray, seq_len: int, total_tokens: int
) -> np.ndarray:
    """Where each sample starts: (position in doc_idx, offset in that document).

    Sample k starts at token k * seq_len of the concatenation; it lies in the first
    document whose end is past it (empty documents are skipped), as Megatron's C++
    `build_sample_idx` walks it.
    """
    num_samples = (total_tokens - 1) // seq_len
    lengths = document_lengths[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    sample_idx = np.stack([position, offset], axis=1)
    sample_idx[0] = 0  # Megatron starts at (0, 0) even before empty documents
    return sample_idx


def _shuffle_index(first_range: int, total: int, rng) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(first_range, dtype=dtype)
    rng.shuffle(first)
    if first_range == total:
        return first
    last = np.arange(first_range, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


class GPTDataset:
    """Pretraining samples of `seq_len + 1` tokens over a range of documents.

    `dataset[i]` is `{"tokens": int64 array of seq_len + 1}`. The length is at least
    `num_samples` (whole epochs are cut, so usually a bit more).

    Args:
        indexed: the tokenized corpus.
        document_range: `(begin, end)` document ids of this split.
        seq_len: tokens per sample fed to the model.
        num_samples: samples needed; 0 builds one epoch.
        seed: seed of the document and sample shuffles.
        cache_dir: where the index files go; default next to the data. When it is
            not writable the indices stay in memory (with a warning).

    Raises:
        DataError: the range holds fewer than `seq_len + 1` tokens.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        document_range: tuple[int, int],
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: str | os.PathLike | None = None,
    ):
        begin, end = (int(x) for x in document_range)
        if not 0 <= begin <= end <= indexed.num_documents:
            raise DataError(
                f"{indexed.prefix}: document range [{begin}, {end}) outside its "
                f"{indexed.num_documents} documents"
            )
        if seq_len < 1 or num_samples < 0:
            raise DataError(f"{indexed.prefix}: bad seq_len={seq_len} or num_samples={num_samples}")
        self.indexed = indexed
        self.seq_len = seq_len
        self._doc_starts, self._doc_lengths = indexed.document_spans()
        num_tokens = int(self._doc_lengths[begin:end].sum())
        if num_tokens < seq_len + 1:
            raise DataError(
                f"{indexed.prefix}: documents [{begin}, {end}) hold {num_tokens} tokens, "
                f"fewer than one sample of seq_len + 1 = {seq_len + 1}"
            )
        description = {
            "version": _INDEX_VERSION,
            "path": str(Path(indexed.prefix).resolve()),
            "documents": [begin, end],
            "num_documents": indexed.num_documents,
            "num_tokens": num_tokens,
            "seq_len": seq_len,
            "num_samples": num_samples,
            "seed": seed,
        }
        self.cache_key = hashlib.sha256(json.dumps(description).encode()).hexdigest()[:16]
        folder = Path(cache_dir) if cache_dir is not None else Path(indexed.prefix).parent
        base = folder / f"{Path(indexed.prefix).name}.{self.cache_key}"
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build(
            base,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            lambda: build_gpt_indices(
                self._doc_lengths,
                np.arange(begin, end),
                seq_len=seq_len,
                num_samples=num_samples,
                seed=seed,
            ),
        )

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Sample `index`: `{"tokens": (seq_len + 1,) int64}`."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        k = int(self.shuffle_idx[index])
        first, first_offset = (int(x) for x in self.sample_idx[k])
        last, last_offset = (int(x) for x in self.sample_idx[k + 1])
        parts = []
        for position in range(first, last + 1):
            doc = int(self.doc_idx[position])
            start = int(self._doc_starts[doc])
            stop = start + int(self._doc_lengths[doc])
            if position == last:
                stop = start + last_offset + 1
            if position == first:
                start += first_offset
            parts.append(self.indexed.tokens[start:stop])
        tokens = np.concatenate(parts).astype(np.int64)
        assert tokens.shape[0] == self.seq_len + 1, (tokens.shape, index)
        return {"tokens": tokens}

    def __repr__(self) -> str:
        return (
            f"GPTDataset({str(self.indexed.prefix)!r}, samples={len(self)}, seq_len={self.seq_len})"
        )


def load_or_build(base: Path, names: tuple[str, ...], build) -> tuple[np.ndarray, ...]:
    """Arrays cached as `<base>.<name>.npy`: memory-mapped when all exist, else built.

    Each file is written to a temporary name and renamed, so concurrent builders
    (several ranks) and crashes never leave a partial file under the final name.
    """
    paths = [Path(f"{base}.{name}.npy") for name in names]
    if all(p.is_file() for p in paths):
        try:
            return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        except (OSError, ValueError) as err:  # unreadable cache: rebuild it
            logger.warning("rebuilding index cache %s: %s", base, err)
    arrays = build()
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, arrays, strict=True):
            _save_atomic(path, array)
    except OSError as err:
        logger.warning("cannot cache dataset indices at %s (%s); keeping them in memory", base, err)
    return tuple(arrays)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
