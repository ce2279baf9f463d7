"""Data parallelism through FSDP2: sharded (ZeRO-3), hybrid (HSDP) and replicated (DDP).

Each block is wrapped on its own, then the root, so parameters are gathered one
block at a time and gradients are reduced while earlier blocks still run
backward. Apply after tensor parallel and activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel.blocks import find_blocks


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    blocks: Iterable[nn.Module] | str | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `module` over `dp_mesh` with FSDP2 (a 2-D mesh gives HSDP); None is a no-op.

    Args:
        dp_mesh: ``dims.mesh("fsdp")``: 1-D shards, 2-D (replicate, shard) is HSDP.
        param_dtype: dtype of the gathered parameters in forward/backward (bf16 for
            mixed precision); the sharded master weights keep their own dtype.
        reduce_dtype: dtype of gradient reduction (fp32 keeps bf16 training stable).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False
            keeps them until backward (ZeRO-2-like: more memory, less communication).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host
            memory (for models on an accelerator).
        blocks: see `find_blocks`.
        ignored_params: parameters FSDP leaves alone (expert-parallel experts whose
            gradients are handled by `apply_expert_fsdp`).

    Raises:
        ParallelError: a mesh of the wrong rank, or cpu_offload for a model already
            in host memory.
    """
    if cpu_offload and _on_cpu(module):
        raise ParallelError(
            "cpu_offload=True moves parameters from an accelerator to host memory; "
            "this model is already on the CPU"
        )
    if dp_mesh is None:
        return module
    if dp_mesh.ndim not in (1, 2):
        raise ParallelError(f"apply_fsdp needs a 1-D or 2-D mesh, got {dp_mesh.ndim}-D")
    options = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "reshard_after_forward": reshard_after_forward,
        "ignored_params": ignored_params or None,
    }
    for block in find_blocks(module, blocks):
        fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def apply_ddp(
    module: nn.Module,
    dp_mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    blocks: Iterable[nn.Module] | str | None = None,
) -> nn.Module:
    """Replicate `module` over `dp_mesh` (all-reduced gradients, no sharding)."""
    if dp_mesh is None:
        return module
    if dp_mesh.ndim != 1:
        raise ParallelError(f"apply_ddp needs a 1-D mesh, got {dp_mesh.ndim}-D")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in find_blocks(module, blocks):
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
    replicate(module, mesh=dp_mesh, mp_policy=mp_policy)
    return module


def _on_cpu(module: nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu"
