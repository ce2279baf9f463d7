"""Check a DCP checkpoint before loading it, so problems surface as CheckpointError.

DCP itself fails deep inside a collective with a message about plans and storage
indices; a user needs to hear "this file is missing" or "this weight is 64x128 in
the checkpoint but 64x256 in the model".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint.storage import read_safe_metadata
from mindspeed_core.errors import CheckpointError

METADATA_FILE = ".metadata"
_SHOW = 5


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of `path`, read without running code (see `storage`)."""
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {METADATA_FILE}: the save did not complete"
        )
    return read_safe_metadata(path)


def check_files(path: Path, metadata: Metadata) -> None:
    """Every shard file the metadata names exists and is long enough."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing shard file {name}")
        if os.path.getsize(file) < size:
            raise CheckpointError(
                f"checkpoint shard {file} is truncated ({os.path.getsize(file)} of {size} bytes)"
            )


def check_states(path: Path, metadata: Metadata, states: Mapping[str, Any]) -> None:
    """Every key the states expect is in the checkpoint, with the same global shape."""
    expected = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in states.items()}
    flat, _ = flatten_state_dict(expected)
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    if missing:
        more = f" and {len(missing) - _SHOW} more" if len(missing) > _SHOW else ""
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing[:_SHOW])}{more}: it was saved from a "
            "different model or training setup"
        )
    for key, value in flat.items():
        meta = saved[key]
        if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        if tuple(meta.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path}: {key} has shape {tuple(meta.size)} but the model "
                f"expects {tuple(value.shape)}; the checkpoint is of a different model shape"
            )
