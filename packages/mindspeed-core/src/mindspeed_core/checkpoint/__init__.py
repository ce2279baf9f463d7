"""Checkpointing over torch.distributed.checkpoint (DCP): atomic, resharding, async;
the step-folder names (`steps`) and the safetensors format (`safetensors`)."""

from mindspeed_core.checkpoint.config import CheckpointConfig
from mindspeed_core.checkpoint.manager import CheckpointManager
from mindspeed_core.checkpoint.states import ModelState, RNGState, TrainState
from mindspeed_core.checkpoint.steps import LATEST, parse_step, step_dir

__all__ = [
    "LATEST",
    "CheckpointConfig",
    "CheckpointManager",
    "ModelState",
    "RNGState",
    "TrainState",
    "parse_step",
    "step_dir",
]
