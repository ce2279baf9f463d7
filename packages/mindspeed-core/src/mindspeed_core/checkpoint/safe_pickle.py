"""DCP's `.metadata`, unpickled without running code: only DCP's own classes resolve.

DCP writes `.metadata` with `pickle.dump` and its reader loads it with `pickle.load`,
which calls whatever the file names. `MetadataUnpickler` resolves only DCP's metadata
classes, torch dtypes/`Size`/layouts and `pathlib` paths; anything else (`os.system`,
`builtins.eval`, ...) is refused before it is called.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from mindspeed_core.errors import CheckpointError

METADATA_FILE = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    _METADATA_MODULE: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core's torch_dist checkpoints keep every rank's save plan in `.metadata`
    # (`all_local_plans`): DCP's own plan dataclasses and an enum, plain data.
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    },
    "torch.serialization": {"_get_layout"},  # a lookup of torch.strided etc. by name
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; refuses every global but DCP's own classes and values.

    Raises:
        pickle.UnpicklingError: the pickle names anything else.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load global {module}.{name}")


def unpickle_metadata(folder: str | Path) -> Metadata:
    """`folder/.metadata` through `MetadataUnpickler` (no integrity check: see
    `storage.read_safe_metadata`).

    Raises:
        CheckpointError: the file is missing, corrupt, or names anything but metadata.
    """
    file = Path(folder) / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {METADATA_FILE}") from None
    except Exception as err:  # any unpickling failure: corrupt or hostile
        raise CheckpointError(
            f"checkpoint metadata {file} is unreadable or unsafe: {err}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata {file} holds {type(metadata).__name__}")
    return metadata
