"""DCP save and load that hold one tensor in memory at a time.

`dcp.save` normally takes a state dict of real tensors, and `dcp.load` fills one. For
conversion the model never needs to be in memory whole: these planners use DCP's own
extension points (`SavePlanner.resolve_data`, `LoadPlanner.resolve_tensor` /
`commit_tensor`) so that a tensor is read from its source only when DCP writes it, and
handed on (then dropped) as soon as DCP has read it. Plans are made from meta tensors,
which carry the shape and dtype DCP needs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from mindspeed_core.errors import MindSpeedError

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


def load_streaming(folder: Path, shapes: Shapes, done: Callable[[str, torch.Tensor], None]) -> None:
    """Read the tensors `shapes` (fqn -> dtype, global shape) of a DCP checkpoint, calling
    `done(fqn, tensor)` for each as soon as it is whole."""
    # Placeholders for planning: the right shape over one element of memory (DCP would
    # materialise meta tensors); the planner allocates the real tensor when it reads.
    state = {
        fqn: torch.empty((), dtype=dtype).expand(shape) for fqn, (dtype, shape) in shapes.items()
    }
    with _single_process():
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(str(folder)),
            planner=_StreamingLoadPlanner(shapes, done),
            no_dist=True,
        )


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
