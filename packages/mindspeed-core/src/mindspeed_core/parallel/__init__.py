"""Parallelism applied from outside a plain model, on PyTorch's own engine.

Order of application (as torchtitan): `split_pipeline` -> `apply_tp` -> `apply_ep` ->
`apply_cp` -> `apply_ac` -> `apply_compile` -> `apply_fsdp` / `apply_ddp` (all but the split on each
pipeline stage). Each takes the mesh
from `ParallelDims.mesh(name)`; a None mesh (degree 1) makes the call a no-op, so one
code path serves every layout. `dtensor.local` / `dtensor.full` turn a tensor that may
be a DTensor into this rank's shard or the whole value.
"""

from mindspeed_core.parallel.ac import AC_MODES, apply_ac
from mindspeed_core.parallel.blocks import find_blocks
from mindspeed_core.parallel.compile import apply_compile
from mindspeed_core.parallel.config import ParallelConfig
from mindspeed_core.parallel.context_parallel import (
    CP_MODES,
    ContextParallel,
    apply_cp,
    cp_degrees,
    gather_tokens,
    packed_shard_index,
    shard_sequence,
    unshard_packed,
    unshard_sequence,
)
from mindspeed_core.parallel.cp_scan import chunk_scan
from mindspeed_core.parallel.data_parallel import apply_ddp, apply_fsdp
from mindspeed_core.parallel.dims import MESH_NAMES, ParallelDims
from mindspeed_core.parallel.expert_parallel import (
    EP_DISPATCHERS,
    AllGatherExpertParallel,
    ExpertParallel,
    all_to_all,
    apply_ep,
    apply_expert_fsdp,
)
from mindspeed_core.parallel.grad_sync import TiedGrads, pipeline_ends_group
from mindspeed_core.parallel.pipeline import (
    SCHEDULES,
    PipelineParts,
    build_pipeline_schedule,
    check_microbatches,
    check_pipeline,
    split_model,
    split_pipeline,
    stage_ids_this_rank,
    stage_layer_counts,
)
from mindspeed_core.parallel.tp import TPPlan, apply_tp, loss_parallel_context

__all__ = [
    "AC_MODES",
    "CP_MODES",
    "ContextParallel",
    "MESH_NAMES",
    "ParallelConfig",
    "ParallelDims",
    "PipelineParts",
    "SCHEDULES",
    "TPPlan",
    "TiedGrads",
    "pipeline_ends_group",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "AllGatherExpertParallel",
    "EP_DISPATCHERS",
    "ExpertParallel",
    "all_to_all",
    "apply_ddp",
    "apply_ep",
    "apply_expert_fsdp",
    "apply_fsdp",
    "apply_tp",
    "chunk_scan",
    "cp_degrees",
    "build_pipeline_schedule",
    "check_microbatches",
    "check_pipeline",
    "find_blocks",
    "gather_tokens",
    "loss_parallel_context",
    "packed_shard_index",
    "shard_sequence",
    "split_model",
    "split_pipeline",
    "stage_ids_this_rank",
    "stage_layer_counts",
    "unshard_packed",
    "unshard_sequence",
]
