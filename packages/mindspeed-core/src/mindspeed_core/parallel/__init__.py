"""Parallelism applied from outside a plain model, on PyTorch's own engine.

Order of application (as torchtitan): `split_pipeline` -> `apply_tp` -> `apply_ac` ->
`apply_fsdp` / `apply_ddp` (the last three on each pipeline stage). Each takes the mesh
from `ParallelDims.mesh(name)`; a None mesh (degree 1) makes the call a no-op, so one
code path serves every layout.
"""

from mindspeed_core.parallel.ac import AC_MODES, apply_ac
from mindspeed_core.parallel.blocks import find_blocks
from mindspeed_core.parallel.data_parallel import apply_ddp, apply_fsdp
from mindspeed_core.parallel.dims import MESH_NAMES, ParallelDims
from mindspeed_core.parallel.pipeline import (
    SCHEDULES,
    PipelineParts,
    build_pipeline_schedule,
    check_pipeline,
    split_pipeline,
    stage_layer_counts,
)
from mindspeed_core.parallel.tp import (
    LlamaNames,
    apply_tp,
    llama_tp_plan,
    loss_parallel_context,
)

__all__ = [
    "AC_MODES",
    "MESH_NAMES",
    "LlamaNames",
    "ParallelDims",
    "PipelineParts",
    "SCHEDULES",
    "apply_ac",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "build_pipeline_schedule",
    "check_pipeline",
    "find_blocks",
    "llama_tp_plan",
    "loss_parallel_context",
    "split_pipeline",
    "stage_layer_counts",
]
