"""Memory and step-time prediction for parallel layouts, and the search over them."""

from mindspeed_core.planning.memory import MemoryEstimate, estimate_memory
from mindspeed_core.planning.shape import Job, Layout, ModelShape

__all__ = ["Job", "Layout", "MemoryEstimate", "ModelShape", "estimate_memory"]
