"""Megatron-compatible indexed datasets: a `<prefix>.bin` + `<prefix>.idx` pair.

The format is Megatron-Core's MMIDIDX version 1, byte for byte, so files written
here train in Megatron (and MindSpeed-LLM) and theirs train here.

`.bin` holds the raw token arrays of every sequence, back to back, without header.
`.idx` (all little-endian):

    magic              b"MMIDIDX\\x00\\x00"          9 bytes
    version            <Q  = 1
    dtype code         <B  (see `DTYPE_CODES`)
    sequence count     <Q  N
    document count     <Q  D + 1 (the number of entries in document_indices)
    sequence_lengths   int32[N]   tokens per sequence
    sequence_pointers  int64[N]   byte offset of each sequence in .bin
    document_indices   int64[D+1] sequence index where each document starts; [0] = 0, [-1] = N

A document is one or more consecutive sequences (pretraining data has one per
document). Optional trailing bytes (Megatron's multimodal sequence modes) are ignored.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
from array import array
from pathlib import Path

import numpy as np

from mindspeed_core.errors import DataError
from mindspeed_core.files import owned_temp_prefix, remove_stale_temps

__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "best_dtype",
    "dataset_exists",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def best_dtype(vocab_size: int | None) -> type[np.number]:
    """The smallest token dtype for a vocabulary, Megatron's rule.

    uint16 when `vocab_size < 65500`, otherwise int32 (also when the size is unknown).
    """
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def _split_prefix(prefix: str | os.PathLike) -> Path:
    """`a/b_text_document`, `a/b_text_document.bin` and `.idx` all name the same pair."""
    path = Path(prefix)
    if path.suffix in (".bin", ".idx"):
        path = path.with_suffix("")
    return path


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{_split_prefix(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{_split_prefix(prefix)}.bin")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """Whether both files of the pair `prefix` exist."""
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


def _code_of(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise DataError(f"unsupported token dtype {dtype!r}; use one of {names}") from None


class IndexedDatasetWriter:
    """Writes an indexed dataset pair, all or nothing.

    Tokens go to temporary files next to the target; `finalize()` writes the index
    and renames both into place, so an interrupted run leaves no half-written pair
    (and an older pair at the same prefix is replaced only at the end). Use it as a
    context manager: on an exception the temporary files are removed.

    Example:
        with IndexedDatasetWriter("data/corpus_text_document", best_dtype(32000)) as w:
            for ids in documents:
                w.add_document(ids + [eod])

    Args:
        prefix: the output path without `.bin`/`.idx`.
        dtype: the token dtype (a numpy dtype of `DTYPE_CODES`).
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = _split_prefix(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _code_of(self.dtype)
        self._bounds = _dtype_bounds(self.dtype)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        # Temporaries of a writer that was killed (SIGKILL, power loss) are ours to remove.
        remove_stale_temps(self.prefix.parent, f".{self.prefix.name}")
        self._sequence_lengths = array("q")
        self._document_indices = array("q", [0])
        self._bin = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in finalize/abort
            mode="wb",
            dir=self.prefix.parent,
            prefix=owned_temp_prefix(f".{self.prefix.name}"),
            suffix=".bin.tmp",
            delete=False,
        )
        self._closed = False

    # -- adding data ------------------------------------------------------------------

    def add_item(self, tokens) -> None:
        """Append one sequence (a list, numpy array or CPU tensor of token ids)."""
        self._check_open()
        values = np.asarray(tokens)
        if values.ndim != 1:
            raise DataError(
                f"{bin_path(self.prefix)}: a sequence must be 1-D, got shape {values.shape}"
            )
        if values.size and self._bounds is not None:
            low, high = self._bounds
            if values.min() < low or values.max() > high:
                raise DataError(
                    f"{bin_path(self.prefix)}: token ids in [{values.min()}, {values.max()}] "
                    f"do not fit dtype {self.dtype.name}; pick a wider dtype (see best_dtype)"
                )
        self._bin.write(values.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sequence_lengths.append(values.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form it."""
        self._check_open()
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens) -> None:
        """Append a document made of one sequence (`add_item` + `end_document`)."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every document of another indexed dataset (same dtype), e.g. a shard."""
        self._check_open()
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{idx_path(prefix)}: dtype {other.dtype.name} differs from the writer's "
                f"{self.dtype.name}"
            )
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        other.close()
        with open(bin_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    # -- finishing ----------------------------------------------------------------------

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._check_open()
        if self._document_indices[-1] != len(self._sequence_lengths):
            self.end_document()  # sequences added after the last end_document() form one
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            self._abort()
            raise DataError(f"{bin_path(self.prefix)}: a sequence is longer than 2**31 - 1 tokens")
        try:  # the last writes: a full disk fails here too, and must leave nothing behind
            self._bin.close()
            self._closed = True
            index_tmp = self._write_index(lengths)
        except BaseException:
            self._abort()
            raise
        final_idx, final_bin = idx_path(self.prefix), bin_path(self.prefix)
        # The .idx goes first and comes last: a crash in between leaves a .bin without
        # an index (refused on load), never a new .bin next to an old .idx.
        with contextlib.suppress(FileNotFoundError):
            final_idx.unlink()
        for temporary in (self._bin.name, index_tmp):  # temporary files are 0600
            os.chmod(temporary, 0o666 & ~_umask())
        os.replace(self._bin.name, final_bin)
        os.replace(index_tmp, final_idx)

    def _write_index(self, lengths: np.ndarray) -> str:
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        out = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
            mode="wb",
            dir=self.prefix.parent,
            prefix=owned_temp_prefix(f".{self.prefix.name}"),
            suffix=".idx.tmp",
            delete=False,
        )
        try:
            with out:
                out.write(MAGIC)
                out.write(struct.pack("<Q", VERSION))
                out.write(struct.pack("<B", self._code))
                out.write(struct.pack("<Q", lengths.size))
                out.write(struct.pack("<Q", documents.size))
                out.write(lengths.astype(np.int32).tobytes(order="C"))
                out.write(pointers.tobytes(order="C"))
                out.write(documents.tobytes(order="C"))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out.name)
            raise
        return out.name

    def _abort(self) -> None:
        self._closed = True
        try:
            if not self._bin.closed:
                self._bin.close()  # flushes: on a full disk this raises ENOSPC again
        except OSError:
            pass  # the data is being thrown away; the unlink below must still happen
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bin.name)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._abort()


def _umask() -> int:
    """The process umask (read by setting it, then put back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _dtype_bounds(dtype: np.dtype) -> tuple[int, int] | None:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    return None


class IndexedDataset:
    """Reads an indexed dataset pair through memory maps (nothing is loaded up front).

    `dataset[i]` is sequence `i` as a read-only numpy view of the `.bin` file.

    Args:
        prefix: the path without `.bin`/`.idx` (a path ending in either is accepted).

    Raises:
        DataError: a file is missing, is not MMIDIDX version 1, or is truncated.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = _split_prefix(prefix)
        self._open()

    def _open(self) -> None:
        index_file, data_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise DataError(f"indexed dataset file not found: {path}")
        code, num_sequences, num_document_entries = _read_header(index_file)
        self.dtype = np.dtype(DTYPE_CODES[code])
        needed = HEADER_SIZE + num_sequences * (4 + 8) + num_document_entries * 8
        if index_file.stat().st_size < needed:
            raise DataError(
                f"{index_file} is truncated: {index_file.stat().st_size} bytes, the header "
                f"announces {num_sequences} sequences and {num_document_entries} document "
                f"entries ({needed} bytes)"
            )
        self._index = np.memmap(index_file, dtype=np.uint8, mode="r")
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._index, np.int32, num_sequences, offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(self._index, np.int64, num_sequences, offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(self._index, np.int64, num_document_entries, offset)
        self._check_documents(index_file, num_sequences)
        self._open_bin(data_file)

    def _check_documents(self, index_file: Path, num_sequences: int) -> None:
        docs = self.document_indices
        if docs.size == 0 or docs[0] != 0 or docs[-1] > num_sequences:
            raise DataError(
                f"{index_file}: document indices must start at 0 and end at most at the "
                f"sequence count {num_sequences}; got {docs[:1].tolist()} ... {docs[-1:].tolist()}"
            )

    def _open_bin(self, data_file: Path) -> None:
        size = data_file.stat().st_size
        if len(self):
            end = (
                int(self.sequence_pointers[-1])
                + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            )
        else:
            end = 0
        if size < end:
            raise DataError(
                f"{data_file} is truncated: {size} bytes, but {idx_path(self.prefix)} "
                f"points to {end} bytes"
            )
        if size == 0:  # numpy cannot map an empty file
            self.tokens = np.empty(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(
                data_file, dtype=self.dtype, mode="r", shape=(size // self.dtype.itemsize,)
            )

    # -- sequences ----------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of sequences."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        """The number of documents."""
        return int(self.document_indices.shape[0]) - 1

    def __getitem__(self, index):
        """Sequence `index` (an int) as a numpy array, or a list of arrays for a slice."""
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `index` (to its end without length)."""
        index = int(index)
        num = len(self)
        if index < 0:
            index += num
        if not 0 <= index < num:
            raise IndexError(f"sequence {index} out of range for {num} sequences in {self.prefix}")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {index} "
                f"of length {size} in {self.prefix}"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    # -- documents ----------------------------------------------------------------------

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(first token, number of tokens) of every document, in elements of `tokens`.

        A document's sequences are consecutive in `.bin` (as every writer lays them
        out), so a document is one slice of `tokens`.
        """
        starts_seq = self.document_indices[:-1]
        ends_seq = self.document_indices[1:]
        cumulative = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=cumulative[1:])
        lengths = cumulative[ends_seq] - cumulative[starts_seq]
        pointers = np.append(self.sequence_pointers, 0)  # empty trailing documents
        starts = pointers[starts_seq] // self.dtype.itemsize
        return starts.astype(np.int64), lengths

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Drop the memory maps (the arrays handed out keep theirs alive)."""
        for name in (
            "tokens",
            "_index",
            "sequence_lengths",
            "sequence_pointers",
            "document_indices",
        ):
            self.__dict__.pop(name, None)

    def __getstate__(self) -> dict:  # reopen in worker processes instead of copying maps
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({str(self.prefix)!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype.name})"
        )


def _read_header(index_file: Path) -> tuple[int, int, int]:
    with open(index_file, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
        raise DataError(
            f"{index_file} is not a Megatron indexed dataset index (bad magic "
            f"{header[: len(MAGIC)]!r}, expected {MAGIC!r})"
        )
    if len(header) < HEADER_SIZE:
        raise DataError(
            f"{index_file} is truncated: {len(header)} bytes, header needs {HEADER_SIZE}"
        )
    (version,) = struct.unpack_from("<Q", header, len(MAGIC))
    if version != VERSION:
        raise DataError(f"{index_file}: unsupported index version {version} (only {VERSION})")
    (code,) = struct.unpack_from("<B", header, len(MAGIC) + 8)
    if code not in DTYPE_CODES:
        raise DataError(f"{index_file}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    num_sequences, num_document_entries = struct.unpack_from("<QQ", header, len(MAGIC) + 9)
    return code, num_sequences, num_document_entries
