"""Checkpointing over torch.distributed.checkpoint (DCP): atomic, verified, resharding,
async, and read without running code from the files; the step-folder names (`steps`)
and the safetensors format (`safetensors`)."""

from mindspeed_core.checkpoint.config import CheckpointConfig
from mindspeed_core.checkpoint.integrity import (
    CHECKSUMS_FILE,
    verify_checksums,
    write_checksums,
)
from mindspeed_core.checkpoint.manager import CheckpointManager
from mindspeed_core.checkpoint.safe_pickle import MetadataUnpickler
from mindspeed_core.checkpoint.states import ModelState, RNGState, TrainState
from mindspeed_core.checkpoint.steps import LATEST, parse_step, step_dir
from mindspeed_core.checkpoint.storage import (
    SafeFileSystemReader,
    load_dcp,
    read_safe_metadata,
)

__all__ = [
    "CHECKSUMS_FILE",
    "LATEST",
    "CheckpointConfig",
    "CheckpointManager",
    "MetadataUnpickler",
    "ModelState",
    "RNGState",
    "SafeFileSystemReader",
    "TrainState",
    "load_dcp",
    "parse_step",
    "read_safe_metadata",
    "step_dir",
    "verify_checksums",
    "write_checksums",
]
