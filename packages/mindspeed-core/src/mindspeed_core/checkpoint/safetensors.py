"""The safetensors file format, read and written tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, data offsets) and the raw tensor bytes. We parse headers ourselves, so a
truncated or corrupt file is reported by name before any tensor is read, and then read
or write one tensor at a time: peak memory stays near the largest tensor, not the
model. Files are those `safetensors.torch.save_file` writes and reads.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mindspeed_core.errors import CheckpointError

# safetensors dtype names <-> torch dtypes (those a checkpoint of ours can hold).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors checkpoint lives, from the file header."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the data from the start of the file."""
    nbytes: int


def read_tensor(info: TensorInfo, f: BinaryIO | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, read straight into fresh memory (no mmap, so the
    process holds only the tensors it keeps)."""
    if f is None:
        with open(info.file, "rb") as own:
            return read_tensor(info, own)
    tensor = torch.empty(info.shape, dtype=info.dtype)
    f.seek(info.offset)
    view = tensor.reshape(-1).view(torch.uint8).numpy()
    if f.readinto(view) != info.nbytes:
        raise CheckpointError(f"safetensors file {info.file} is truncated")
    return tensor


def read_tensor_block(
    info: TensorInfo,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    f: BinaryIO | None = None,
) -> torch.Tensor:
    """The block `offsets` / `sizes` of one tensor of a safetensors file, reading only its
    bytes (one contiguous run per index of the leading dims the block cuts; a block of whole
    rows is one read). What a rank reads of a weight it holds a shard of.

    Raises:
        CheckpointError: the block lies outside the tensor, or the file is truncated.
    """
    if f is None:
        with open(info.file, "rb") as own:
            return read_tensor_block(info, offsets, sizes, own)
    shape = info.shape
    if len(offsets) != len(shape) or any(
        o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)
    ):
        raise CheckpointError(
            f"safetensors file {info.file}: block at {tuple(offsets)} of {tuple(sizes)} lies "
            f"outside a tensor of shape {shape}"
        )
    if not shape:
        return read_tensor(info, f)
    out = torch.empty(sizes, dtype=info.dtype)
    if out.numel() == 0:
        return out
    # dims [cut:] are taken whole below dim `cut - 1`, so each index of dims [:cut-1] is one run
    cut = len(shape)
    while cut > 0 and (cut == len(shape) or (offsets[cut], sizes[cut]) == (0, shape[cut])):
        cut -= 1
    run = sizes[cut] * math.prod(shape[cut + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    flat = out.reshape(-1, run)
    itemsize = info.dtype.itemsize
    for row, index in enumerate(itertools.product(*(range(s) for s in sizes[:cut]))):
        start = sum((o + i) * st for o, i, st in zip(offsets, index, strides, strict=False))
        start += offsets[cut] * strides[cut]
        f.seek(info.offset + start * itemsize)
        view = flat[row].view(torch.uint8).numpy()
        if f.readinto(view) != run * itemsize:
            raise CheckpointError(f"safetensors file {info.file} is truncated")
    return out


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Name -> `TensorInfo` from a safetensors header, checking sizes against the file's.

    Raises:
        CheckpointError: the file is missing, truncated or its header is corrupt.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"safetensors file {file} is truncated ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"safetensors file {file} is truncated or corrupt (header of {header_len} "
                    f"bytes in a file of {size})"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file {file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"safetensors file {file} has a corrupt header: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"safetensors file {file} has a corrupt header")
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, stop = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"safetensors file {file}: tensor {name} has an unsupported or corrupt entry "
                f"{entry!r}"
            ) from None
        nbytes = math.prod(shape) * dtype.itemsize
        if stop - start != nbytes or start < 0:
            raise CheckpointError(f"safetensors file {file}: tensor {name} has corrupt offsets")
        if 8 + header_len + stop > size:
            raise CheckpointError(
                f"safetensors file {file} is truncated ({size} bytes; tensor {name} ends at "
                f"{8 + header_len + stop})"
            )
        out[name] = TensorInfo(file, dtype, shape, 8 + header_len + start, nbytes)
    return out


class SafetensorsWriter:
    """Writes one safetensors file whose tensors arrive one at a time, in any order.

    The header (names, dtypes, shapes, offsets) is written up front from `entries`, so
    each tensor goes straight to its place and is dropped: memory stays at one tensor.
    """

    def __init__(self, file: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        to_name = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": to_name[dtype],
                "shape": list(shape),
                "data_offsets": [end, end + nbytes],
            }
            self.offsets[name] = (end, nbytes)
            end += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(raw)
        self.size = end
        self.file = file
        self._f = open(file, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self.data_start + end)
        self._pending = set(self.offsets)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        start, nbytes = self.offsets[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == nbytes, (name, data.numel(), nbytes)
        self._f.seek(self.data_start + start)
        self._f.write(data.numpy().data)
        self._pending.discard(name)

    def close(self, check: bool = True) -> None:
        """Close the file; with `check`, every tensor must have been written (else an
        internal error). `check=False` after a failure, whose output is discarded anyway."""
        self._f.close()
        if check:
            assert not self._pending, f"{self.file}: never written: {sorted(self._pending)[:5]}"
