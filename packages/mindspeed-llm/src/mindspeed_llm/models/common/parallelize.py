"""Parallelise a dense `Transformer` from outside: TP -> activation checkpointing -> FSDP/DDP.

The order is torchtitan's: tensor parallel first (DTensor plans on whole modules), then
recompute wrappers on each block, then data parallel, which shards whatever parameters
(plain or already TP-sharded DTensors) it finds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import (
    ParallelDims,
    apply_ac,
    apply_ddp,
    apply_fsdp,
    apply_tp,
    llama_tp_plan,
)


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    *,
    ac_mode: str = "none",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Apply the layout `dims` to `model` in place and return it.

    Args:
        model: a `Transformer` (torchtitan submodule names, `config` attribute).
        dims: the parallel layout; its meshes are built on first use.
        ac_mode: activation checkpointing per block: "none", "full" or "selective".
        param_dtype: dtype of gathered parameters in forward/backward (FSDP/DDP mixed
            precision); None keeps the parameters' dtype.
        reduce_dtype: dtype of the gradient reduction.
        sequence_parallel: shard norms and residuals along the sequence (needs tp > 1).
        loss_parallel: leave logits sharded over the vocabulary (tp > 1); compute the loss
            inside `mindspeed_core.parallel.loss_parallel_context(True)`.

    Raises:
        ParallelError: a layout these models do not support yet (cp, pp, ep), or options
            that need tensor parallel without it.
    """
    for axis in ("cp", "pp", "ep"):
        if dims.degree(axis) > 1:
            raise ParallelError(f"{axis}={dims.degree(axis)} is not supported by dense models yet")
    if dims.tp == 1 and (sequence_parallel or loss_parallel):
        raise ParallelError("sequence_parallel and loss_parallel need tp > 1")
    config = model.config
    if dims.tp > 1:
        if config.tie_word_embeddings:
            raise ParallelError(
                "tensor parallel with tie_word_embeddings=true is not supported yet"
            )
        plan = llama_tp_plan(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            tp=dims.tp,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )
        apply_tp(model, dims.mesh("tp"), plan)
        if config.qk_norm:
            _replicate_qk_norms(model, dims.mesh("tp"))
    apply_ac(model, ac_mode)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.mesh("fsdp"), param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    else:
        apply_ddp(
            model, dims.mesh("dp_replicate"), param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    return model


def _replicate_qk_norms(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the per-head q/k norm weights replicated DTensors over the tp mesh.

    Each rank normalises only its own heads, so each sees part of the weights' gradient;
    as DTensors, `RMSNorm` marks that gradient Partial and DTensor sums it over ranks.
    """
    for layer in model.layers.values():
        distribute_module(layer.attention.q_norm, tp_mesh)
        distribute_module(layer.attention.k_norm, tp_mesh)
