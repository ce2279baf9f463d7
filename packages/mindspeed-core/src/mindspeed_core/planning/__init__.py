"""Memory and step-time prediction for parallel layouts, and the search over them.

    shape = ModelShape(...)            # mindspeed_llm.models.shape.model_shape(config)
    job = Job(seq_len=4096, global_batch=512, precision="bf16")
    estimate_memory(shape, Layout(tp=2, dp_shard=4, ac="selective"), job).peak
    plan(shape, job, devices=64, memory_gb=80, calibration=calib)[0].layout
"""

from mindspeed_core.planning.cost import Calibration, StepTime, estimate_step_time
from mindspeed_core.planning.memory import (
    MemoryEstimate,
    estimate_memory,
    estimate_memory_per_stage,
)
from mindspeed_core.planning.search import Candidate, PlanError, enumerate_layouts, plan
from mindspeed_core.planning.shape import Job, Layout, ModelShape

__all__ = [
    "Calibration",
    "Candidate",
    "Job",
    "Layout",
    "MemoryEstimate",
    "ModelShape",
    "PlanError",
    "StepTime",
    "enumerate_layouts",
    "estimate_memory",
    "estimate_memory_per_stage",
    "estimate_step_time",
    "plan",
]
