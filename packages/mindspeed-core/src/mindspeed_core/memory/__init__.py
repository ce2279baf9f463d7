"""Memory features: activation offload to host memory. (Optimizer-state offload is FSDP2's
CPU offload: `apply_fsdp(..., cpu_offload=True)`.)"""

from mindspeed_core.memory.offload import ActivationOffload, OffloadStats, offload_activations

__all__ = ["ActivationOffload", "OffloadStats", "offload_activations"]
