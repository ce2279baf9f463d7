"""Training utilities: determinism, throughput and MFU accounting, metrics files."""

from mindspeed_core.training.determinism import derive_seed, enable_determinism, set_seed
from mindspeed_core.training.metrics import MetricsWriter, WandbOptions, check_wandb, read_metrics
from mindspeed_core.training.run_lock import RunLock, acquire_run_lock, release_all
from mindspeed_core.training.throughput import (
    ThroughputMeter,
    dense_params,
    flops_per_token,
    mfu,
    moe_active_params,
)

__all__ = [
    "MetricsWriter",
    "RunLock",
    "ThroughputMeter",
    "WandbOptions",
    "acquire_run_lock",
    "check_wandb",
    "dense_params",
    "derive_seed",
    "enable_determinism",
    "flops_per_token",
    "mfu",
    "moe_active_params",
    "read_metrics",
    "release_all",
    "set_seed",
]
