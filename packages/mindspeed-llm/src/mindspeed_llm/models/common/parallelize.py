"""Parallelise a `Transformer` (dense or MoE) from outside: (pipeline split) -> TP -> EP ->
CP -> activation checkpointing -> FSDP/DDP.

The order is torchtitan's: tensor parallel first (DTensor plans on whole modules), then
recompute wrappers on each block, then data parallel, which shards whatever parameters
(plain or already TP-sharded DTensors) it finds.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module

from mindspeed_core.errors import ParallelError
from mindspeed_core.memory import offload_activations
from mindspeed_core.parallel import (
    ParallelDims,
    PipelineParts,
    apply_ac,
    apply_cp,
    apply_ddp,
    apply_ep,
    apply_expert_fsdp,
    apply_fsdp,
    apply_tp,
    check_pipeline,
    split_pipeline,
)
from mindspeed_llm.models.common.moe import MoE
from mindspeed_llm.models.common.tp_plan import llama_tp_plan
from mindspeed_ops import attention


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    *,
    ac_mode: str = "none",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    cp_mode: str = "ring",
    ulysses_degree: int | None = None,
    activation_offload: bool = False,
    cpu_offload: bool = False,
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
        cp_mode: context parallel attention when cp > 1: "ring", "ulysses" or "hybrid"
            (`ulysses_degree` ranks inside each ring step); the caller feeds zig-zag
            sequence shards and global positions (see `mindspeed_core.parallel.apply_cp`).
        activation_offload: each block's saved activations wait in host memory
            (`mindspeed_core.memory.offload_activations`; accelerators, no recompute).
        cpu_offload: FSDP2's CPU offload of sharded parameters, gradients and optimizer
            states (accelerators, with FSDP).

    Raises:
        ParallelError: a layout these models do not support yet (ep without experts or
            with tp/dp_replicate, tp with experts), a whole model
            under pp > 1 (see `pipeline_decoder`), or options that need tensor parallel
            without it.
    """
    if dims.pp > 1 and None not in (model.tok_embeddings, model.output):
        raise ParallelError(
            f"pp={dims.pp}: split the model into stages with pipeline_decoder, not parallelize_decoder"
        )
    if dims.tp == 1 and (sequence_parallel or loss_parallel):
        raise ParallelError("sequence_parallel and loss_parallel need tp > 1")
    config = model.config
    if dims.tp > 1:
        if config.num_experts:
            raise ParallelError(f"tp={dims.tp} for MoE models is not supported yet; use ep")
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
        apply_tp(model, dims.mesh("tp"), _owned_entries(plan, model))
        if config.qk_norm:
            _replicate_qk_norms(model, dims.mesh("tp"))
    experts_ignored_by_fsdp = _expert_parallel(model, dims, param_dtype, reduce_dtype)
    attention_fn = functools.partial(attention, impl=config.ops_impl)
    apply_cp(model, dims.mesh("cp"), mode=cp_mode, ulysses_degree=ulysses_degree,
             attention_fn=attention_fn)  # fmt: skip
    apply_ac(model, ac_mode)
    if cpu_offload and not dims.fsdp_enabled:
        raise ParallelError("cpu_offload (optimizer-state offload) needs FSDP: dp_shard x cp > 1")
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            ignored_params=experts_ignored_by_fsdp,
            cpu_offload=cpu_offload,
        )
    else:
        apply_ddp(
            model, dims.mesh("dp_replicate"), param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    if activation_offload:  # last: FSDP's hooks must gather parameters before it looks
        offload_activations(model)
    return model


def pipeline_decoder(
    model: nn.Module,
    dims: ParallelDims,
    *,
    device: torch.device | str,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    **options,
) -> PipelineParts:
    """This rank's pipeline stages of `model`, each parallelised like a whole model.

    torchtitan's order: split first (`split_pipeline`: each stage a copy holding its own
    layers under their original names), then TP -> AC -> FSDP/DDP on every stage with
    `parallelize_decoder(stage, dims, **options)`. Initialise `model` whole before (with
    the run's seed) and a pipelined run starts from one process's weights.

    Raises:
        ParallelError: pp=1, tied embeddings (they would sit on two stages), or a layout
            `check_pipeline` refuses (recompute under zero-bubble schedules included).
    """
    if dims.pp == 1:
        raise ParallelError("pipeline_decoder needs pp > 1; use parallelize_decoder")
    if model.config.tie_word_embeddings:
        raise ParallelError(
            "pipeline parallel with tie_word_embeddings=true is not supported: the embedding "
            "and the output projection would sit on different stages"
        )
    check_pipeline(
        num_layers=len(model.layers),
        pp=dims.pp,
        stages_per_rank=stages_per_rank,
        schedule=schedule,
        layers_per_stage=layers_per_stage,
        recompute=options.get("ac_mode", "none") != "none",
    )
    parts = split_pipeline(
        model,
        dims.mesh("pp"),
        device=device,
        stages_per_rank=stages_per_rank,
        schedule=schedule,
        layers_per_stage=layers_per_stage,
    )
    for part in parts.model_parts:
        parallelize_decoder(part, dims, **options)
    return parts


def _owned_entries(plan: dict, model: nn.Module) -> dict:
    """The plan entries naming submodules `model` has (a pipeline stage lacks some)."""
    names = [n for n, _ in model.named_modules() if n]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}


def _expert_parallel(
    model: nn.Module, dims: ParallelDims, param_dtype, reduce_dtype
) -> set[nn.Parameter]:
    """Experts over `ep` (all-to-all), their own FSDP over `dp_shard_mod_ep`; returns the
    expert parameters the model-wide FSDP must leave alone."""
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    if dims.ep == 1:
        return set()
    if not experts:
        raise ParallelError(f"ep={dims.ep} needs a MoE model (num_experts > 0)")
    if dims.dp_replicate > 1 or dims.tp > 1:
        raise ParallelError(
            f"ep={dims.ep} with dp_replicate={dims.dp_replicate} or tp={dims.tp} > 1 is not "
            "supported yet; use dp_shard (and cp)"
        )
    apply_ep(experts, dims.mesh("ep"))
    return apply_expert_fsdp(
        experts,
        dims.mesh("dp_shard_mod_ep"),
        grad_divide_factor=dims.degree("dp_shard_cp"),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )


def _replicate_qk_norms(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the per-head q/k norm weights replicated DTensors over the tp mesh.

    Each rank normalises only its own heads, so each sees part of the weights' gradient;
    as DTensors, `RMSNorm` marks that gradient Partial and DTensor sums it over ranks.
    """
    for layer in model.layers.values():
        distribute_module(layer.attention.q_norm, tp_mesh)
        distribute_module(layer.attention.k_norm, tp_mesh)
