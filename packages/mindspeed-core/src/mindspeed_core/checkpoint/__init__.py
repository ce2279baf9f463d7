"""Checkpointing over torch.distributed.checkpoint (DCP): atomic, resharding, async."""

from mindspeed_core.checkpoint.manager import LATEST, CheckpointManager
from mindspeed_core.checkpoint.states import ModelState, RNGState, TrainState

__all__ = ["LATEST", "CheckpointManager", "ModelState", "RNGState", "TrainState"]
