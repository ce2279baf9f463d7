"""Reading DCP checkpoints without running code from them.

DCP's own `FileSystemReader` unpickles `.metadata` with a plain `pickle.load`, and its
default planner loads every non-tensor item with `torch.load(weights_only=False)`: a
checkpoint from a stranger could run anything on load. `SafeFileSystemReader` (a DCP
`StorageReader`, its public extension point) closes both doors:

- `.metadata` goes through `MetadataUnpickler`, which resolves only DCP's metadata
  classes, torch dtypes/`Size`/layouts and `pathlib` paths; anything else (os.system,
  builtins.eval, ...) is refused before it is called.
- a non-tensor item is first read with `torch.load(weights_only=True)` (ints, floats,
  strings, lists, dicts, tuples, tensors); only bytes that pass reach the planner.
  Tensors DCP already reads with `weights_only=True`.

Where the folder has `checksums.json` (see `integrity`), `.metadata` and every record
about to be read are checked against it first.

A record that does not unpickle (a corrupt shard) becomes a `CheckpointError` naming
the shard file. `load_dcp` is the one way our code calls `dcp.load`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from mindspeed_core.checkpoint.integrity import read_checksums
from mindspeed_core.checkpoint.safe_pickle import (
    METADATA_FILE,
    unpickle_metadata,
)
from mindspeed_core.errors import CheckpointError, MindSpeedError


def read_safe_metadata(path: str | Path) -> Metadata:
    """The `Metadata` of the DCP checkpoint folder `path`: checked against its checksums
    when it has them, then read with `MetadataUnpickler`.

    Raises:
        CheckpointError: the file is missing, corrupt, or names anything but metadata.
    """
    if (Path(path) / METADATA_FILE).is_file():
        checksums = read_checksums(Path(path))
        if checksums is not None:
            checksums.check_metadata()  # a corrupt (or swapped) file is named, not unpickled
    return unpickle_metadata(path)


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader` that executes nothing it reads (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported")
        metadata = read_safe_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._checksums = read_checksums(Path(self.path))
        if self._checksums is not None:
            self._checksums.check_sizes()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        spans: dict[str, set[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            spans.setdefault(info.relative_path, set()).add((info.offset, info.length))
        if getattr(self, "_checksums", None) is not None:
            for name, wanted in sorted(spans.items()):
                self._checksums.check_records(name, wanted)
        files = sorted(spans)
        try:
            return super().read_data(plan, _WeightsOnlyBytes(planner))
        except MindSpeedError:
            raise
        except (
            pickle.UnpicklingError,
            RuntimeError,
            EOFError,
            ValueError,
            OSError,
            AssertionError,
        ) as err:
            # (DCP asserts a record's size; a corrupt one trips it)
            names = ", ".join(files) if len(files) <= 3 else f"{files[0]} ... ({len(files)} files)"
            raise CheckpointError(
                f"checkpoint {self.path}: shard {names} is corrupt or unreadable "
                f"({err.__class__.__name__}: {' '.join(str(err).split())[:200]})"
            ) from None


class _WeightsOnlyBytes:
    """A planner seen through a filter: non-tensor bytes must load with weights_only=True
    before the real planner (which loads them with weights_only=False) sees them."""

    def __init__(self, planner: LoadPlanner):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as err:
            fqn = read_item.dest_index.fqn
            raise CheckpointError(
                f"checkpoint item {fqn} is not plain data (refused to unpickle it): "
                f"{' '.join(str(err).split())[:200]}"
            ) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def load_dcp(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """`dcp.load(state)` from folder `path` through `SafeFileSystemReader`.

    A user error raised while reading (a corrupt shard, a refused pickle) comes out as
    itself, not wrapped in DCP's multi-rank `CheckpointException`.
    """
    read_safe_metadata(path)  # its errors as ours, before DCP retries and logs them
    # no collectives in a world of one (see `CheckpointManager._write`)
    no_dist = not dist.is_initialized() or dist.get_world_size(process_group) == 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(path)),
                planner=planner,
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as err:
        raise_user_error(err)
        raise


def raise_user_error(err: CheckpointException) -> None:
    """Re-raise the first `MindSpeedError` any rank hit inside a DCP call, if there is one."""
    for failure, _ in err.failures.values():
        if isinstance(failure, MindSpeedError):
            raise failure from None
