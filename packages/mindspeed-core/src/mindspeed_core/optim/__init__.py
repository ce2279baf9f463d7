"""Optimizers (AdamW, Muon, bf16 moments), learning-rate schedules, gradient clipping and
fp16 loss scaling."""

from mindspeed_core.optim.adamw import LowPrecisionAdamW
from mindspeed_core.optim.clip import clip_grad_norm_, total_grad_norm
from mindspeed_core.optim.config import OptimConfig
from mindspeed_core.optim.loss_scale import DynamicLossScaler
from mindspeed_core.optim.muon import Muon, hidden_matrices
from mindspeed_core.optim.optimizer import (
    OptimizerMoments,
    OptimizersContainer,
    build_optimizers,
    check_adamw_args,
    param_groups,
)
from mindspeed_core.optim.scheduler import (
    DECAY_STYLES,
    LRSchedulersContainer,
    build_lr_schedulers,
    lr_multiplier,
)

__all__ = [
    "DECAY_STYLES",
    "DynamicLossScaler",
    "LRSchedulersContainer",
    "LowPrecisionAdamW",
    "Muon",
    "OptimConfig",
    "OptimizerMoments",
    "OptimizersContainer",
    "build_lr_schedulers",
    "build_optimizers",
    "check_adamw_args",
    "clip_grad_norm_",
    "hidden_matrices",
    "lr_multiplier",
    "param_groups",
    "total_grad_norm",
]
