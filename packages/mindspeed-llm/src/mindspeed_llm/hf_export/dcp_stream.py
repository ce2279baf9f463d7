"""DCP save and load that hold one tensor in memory at a time.

`dcp.save` normally takes a state dict of real tensors, and `dcp.load` fills one. For
conversion the model never needs to be in memory whole: these planners use DCP's own
extension points (`SavePlanner.resolve_data`, `LoadPlanner.resolve_tensor` /
`commit_tensor`) so that a tensor is read from its source only when DCP writes it, and
handed on (then dropped) as soon as DCP has read it. Plans are made from meta tensors,
which carry the shape and dtype DCP needs. `iter_regions` reads boxes of stored tensors
(one layer of Megatron's layer-stacked tensors) a few at a time, through DCP's own
resharding (`create_read_items_for_chunk_list`).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mindspeed_core.checkpoint import SafeFileSystemReader, read_safe_metadata
from mindspeed_core.checkpoint.integrity import read_checksums, write_checksums
from mindspeed_core.errors import CheckpointError, MindSpeedError

Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class _LazySavePlanner(DefaultSavePlanner):
    """Asks `read(fqn)` for each tensor when DCP is about to write it."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        super().__init__()
        self._read = read

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._read(write_item.index.fqn)


class _StreamingLoadPlanner(DefaultLoadPlanner):
    """Allocates each tensor when DCP first reads into it; `done(fqn, tensor)` when complete.

    A tensor saved in several chunks (FSDP/TP shards) is complete once every chunk the
    plan reads for it has been committed.
    """

    def __init__(self, shapes: Shapes, done: Callable[[str, torch.Tensor], None]):
        super().__init__(allow_partial_load=True)
        self._shapes = shapes
        self._done = done
        self._buffers: dict[str, torch.Tensor] = {}
        self._left: Counter[str] = Counter()

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._left = Counter(item.dest_index.fqn for item in plan.items)
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn not in self._buffers:
            dtype, shape = self._shapes[index.fqn]
            self._buffers[index.fqn] = torch.empty(shape, dtype=dtype)
        return self._buffers[index.fqn]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        self._left[fqn] -= 1
        if self._left[fqn] == 0:
            self._done(fqn, self._buffers.pop(fqn))


def save_streaming(folder: Path, shapes: Shapes, read: Callable[[str], torch.Tensor]) -> None:
    """Write a DCP checkpoint of the flat `shapes` (fqn -> dtype, shape), reading each tensor
    with `read(fqn)` only when it is written (one file per tensor, so none is kept)."""
    state = {
        fqn: torch.empty(shape, dtype=dtype, device="meta")
        for fqn, (dtype, shape) in shapes.items()
    }
    with _single_process():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(folder), single_file_per_rank=False),
            planner=_LazySavePlanner(read),
            no_dist=True,
        )
    write_checksums(folder)  # as CheckpointManager does: every load checks what it reads


def load_streaming(folder: Path, shapes: Shapes, done: Callable[[str, torch.Tensor], None]) -> None:
    """Read the tensors `shapes` (fqn -> dtype, global shape) of a DCP checkpoint, calling
    `done(fqn, tensor)` for each as soon as it is whole.

    A tensor stored whole (as `mindspeed convert` and unsharded runs write them) is read
    straight from its file: one copy in memory. One stored in shards (FSDP/TP runs) goes
    through DCP, which assembles it in a buffer: that buffer plus one shard.
    """
    metadata = read_safe_metadata(folder)  # runs no code from the file
    checksums = read_checksums(folder)
    if checksums is not None:
        checksums.check_sizes()
    sharded = {}
    for fqn, (dtype, shape) in shapes.items():
        info = _whole_tensor_storage(metadata, fqn, shape)
        if info is None:
            sharded[fqn] = (dtype, shape)
            continue
        if checksums is not None:
            checksums.check_records(info.relative_path, [(info.offset, info.length)])
        tensor = _read_record(folder, info, fqn)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"checkpoint shard {folder / info.relative_path}: {fqn} holds a "
                f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}, but .metadata says "
                f"{dtype} of shape {shape}"
            )
        done(fqn, tensor)
        del tensor
    if not sharded:
        return
    # Placeholders for planning: the right shape over one element of memory (DCP would
    # materialise meta tensors); the planner allocates the real tensor when it reads.
    state = {fqn: torch.empty((), dtype=d).expand(s) for fqn, (d, s) in sharded.items()}
    with _single_process():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=_StreamingLoadPlanner(sharded, done),
            no_dist=True,
        )


@dataclass(frozen=True)
class Region:
    """The box [offsets, offsets + sizes) of the stored tensor `fqn`."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.sizes).numel() * self.dtype.itemsize


class RegionReader:
    """Boxes (`Region`s) of the tensors of a DCP checkpoint, planned once through DCP's own
    resharding (`create_read_items_for_chunk_list`) and checked against the files before
    anything is read; `items` reads them a few at a time.

    Raises:
        CheckpointError: a region's tensor is not in the checkpoint, its stored chunks do
            not cover it, or a file they are in is missing or too short (named).
    """

    def __init__(self, folder: Path, regions: Mapping[str, Region]):
        self.folder = folder
        self.regions = dict(regions)
        self._metadata = read_safe_metadata(folder)  # runs no code from the file
        self._items = _plan_regions(folder, self._metadata, self.regions)
        _check_files(folder, self._metadata, self._items.values())

    def items(self, *, budget: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor of that region) for each region, in their order. One `dcp.load`
        reads consecutive regions of at most `budget` bytes together (at least one), so
        memory holds about `budget` bytes of them, whatever the checkpoint's size."""
        reader = _MetadataOnce(self.folder, self._metadata)
        batch: list[str] = []
        size = 0
        for key, region in [*self.regions.items(), (None, None)]:
            if batch and (key is None or size + region.nbytes > budget):
                got: dict[str, torch.Tensor] = {}
                plan = {k: (self.regions[k], self._items[k]) for k in batch}
                with _single_process():
                    dcp.load({}, storage_reader=reader, planner=_RegionLoadPlanner(plan, got),
                             no_dist=True)  # fmt: skip
                for name in batch:
                    yield name, got.pop(name)
                batch, size = [], 0
            if key is not None:
                batch.append(key)
                size += region.nbytes


def _plan_regions(
    folder: Path, metadata, regions: Mapping[str, Region]
) -> dict[str, list[ReadItem]]:
    """Each region's DCP read items, planned once per stored tensor (DCP's sweep over its
    saved chunks), checked to cover the region."""
    by_fqn: dict[str, list[str]] = {}
    for key, region in regions.items():
        by_fqn.setdefault(region.fqn, []).append(key)
    items: dict[str, list[ReadItem]] = {key: [] for key in regions}
    for fqn, keys in by_fqn.items():
        meta = metadata.state_dict_metadata.get(fqn)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{folder}: its .metadata holds no tensor {fqn}")
        chunks = [
            ChunkStorageMetadata(
                offsets=torch.Size(regions[k].offsets), sizes=torch.Size(regions[k].sizes)
            )
            for k in keys
        ]
        for item in create_read_items_for_chunk_list(fqn, meta, chunks):
            items[keys[item.dest_index.index]].append(item)
    for key, region in regions.items():
        covered = sum(torch.Size(item.lengths).numel() for item in items[key])
        if covered != torch.Size(region.sizes).numel():
            raise CheckpointError(
                f"{folder}: the stored chunks of {region.fqn} do not cover "
                f"{list(region.offsets)} + {list(region.sizes)}"
            )
    return items


def _check_files(folder: Path, metadata, planned) -> None:
    """Every file the planned reads need exists and reaches their last byte."""
    ends: dict[str, int] = {}
    for items in planned:
        for item in items:
            info = metadata.storage_data.get(item.storage_index)
            if info is None:
                fqn = item.storage_index.fqn
                raise CheckpointError(f"{folder}: .metadata has no record of {fqn}")
            end = info.offset + info.length
            ends[info.relative_path] = max(end, ends.get(info.relative_path, 0))
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint file {path} is truncated ({size} bytes; a record ends at {end})"
            )


class _MetadataOnce(SafeFileSystemReader):
    """A reader for many `dcp.load`s of one folder: its metadata is read (safely) once."""

    def __init__(self, folder: Path, metadata):
        super().__init__(str(folder))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads planned regions: each buffer is made when DCP first reads into it and moves
    to `got[key]` once every read item of its region is in."""

    def __init__(self, plan: dict[str, tuple[Region, list[ReadItem]]], got: dict):
        super().__init__(allow_partial_load=True)
        self._plan = plan
        self._got = got
        self._keys = {(r.fqn, tuple(r.offsets)): k for k, (r, _) in plan.items()}
        self._left = Counter({k: len(items) for k, (_, items) in plan.items()})
        self._buffers: dict[str, torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([item for _, items in self._plan.values() for item in items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        key = self._keys[(index.fqn, tuple(index.offset))]
        if key not in self._buffers:
            region = self._plan[key][0]
            self._buffers[key] = torch.empty(region.sizes, dtype=region.dtype)
        return self._buffers[key]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        key = self._keys[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        self._left[key] -= 1
        if self._left[key] == 0:
            self._got[key] = self._buffers.pop(key)


def _read_record(folder: Path, info, fqn: str) -> torch.Tensor:
    """One tensor record of a DCP file (weights_only: plain tensors, nothing executed)."""
    path = folder / info.relative_path
    try:
        with open(path, "rb") as f:
            return torch.load(_FileSlice(f, info.offset, info.length), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:
        raise CheckpointError(
            f"checkpoint shard {path} is corrupt or unreadable at {fqn} "
            f"({err.__class__.__name__}: {' '.join(str(err).split())[:200]})"
        ) from None


def _whole_tensor_storage(metadata, fqn: str, shape: tuple[int, ...]):
    """DCP's storage record of `fqn` when it is saved as one chunk with no transforms."""
    meta = metadata.state_dict_metadata.get(fqn)
    chunks = getattr(meta, "chunks", None)
    if not chunks or len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(shape):
        return None
    info = metadata.storage_data.get(MetadataIndex(fqn, chunks[0].offsets))
    if info is None or getattr(info, "transform_descriptors", None):
        return None
    return info


class _FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own
    (what `torch.load` needs to read one record of a DCP file)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n])
        self._pos += got
        return got


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Quiet DCP's "assuming a single process" warning, and re-raise a user error that
    happened while reading a tensor (DCP wraps it in a CheckpointException)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, MindSpeedError):
                raise exc from None
        raise
