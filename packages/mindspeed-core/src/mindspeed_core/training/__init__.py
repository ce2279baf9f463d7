"""Training utilities: determinism, throughput and MFU accounting."""

from mindspeed_core.training.determinism import derive_seed, enable_determinism, set_seed
from mindspeed_core.training.throughput import (
    ThroughputMeter,
    dense_params,
    flops_per_token,
    mfu,
    moe_active_params,
)

__all__ = [
    "ThroughputMeter",
    "dense_params",
    "derive_seed",
    "enable_determinism",
    "flops_per_token",
    "mfu",
    "moe_active_params",
    "set_seed",
]
