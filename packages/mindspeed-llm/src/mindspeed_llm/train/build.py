"""Build what a training run holds: the model on its layout, then optimizer and checkpoints.

`build_model` goes model config -> the model on the meta device (a Hugging Face folder's
headers checked against it) -> the family's parallelize (TP -> `after_tp` -> EP -> CP ->
recompute -> FSDP) or pipeline split, with `before_tp` for a new head first -> this rank's
shards on the device, read from the folder block by block or drawn from the run's seed by
name (`models.startup`): no rank holds more than its shards plus one tensor, and every
layout starts from one process's weights. With `frozen=True` it gives an optimizer-less
copy under the same layout (a DPO or KL reference). `build_train_parts` adds AdamW, the LR
schedule, the fp16 loss scaler and the train counters, and `TrainParts.states` names
everything a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint import ModelState, RNGState, TrainState
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import (
    DynamicLossScaler,
    LRSchedulersContainer,
    OptimConfig,
    OptimizersContainer,
)
from mindspeed_core.parallel import ParallelConfig, ParallelDims, PipelineParts
from mindspeed_core.training import flops_per_token, set_seed
from mindspeed_llm.models import TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.moe_stats import LoadTracker, active_params
from mindspeed_llm.models.common.parallelize import ModelHook
from mindspeed_llm.models.hf_io import check_hf_weights, read_hf_config
from mindspeed_llm.models.startup import base_shapes, build_meta, fill_parts
from mindspeed_llm.train.compile import compile_mode
from mindspeed_llm.train.config import ModelSection
from mindspeed_llm.train.objectives import LossContext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["DTYPES", "BuiltModel", "TrainParts", "build_model", "build_train_parts", "model_config"]


@dataclass
class BuiltModel:
    """One rank's share of a model, parallelised."""

    config: TransformerConfig
    device: torch.device
    model: nn.Module | None
    """The whole (parallelised) model; None under pipeline parallel."""
    parts: list[nn.Module]
    """What to optimise and checkpoint: [model], or this rank's pipeline stages."""
    pipeline: PipelineParts | None
    """The stages to schedule (pp > 1)."""
    pipeline_schedule: str | None
    """Their schedule's name (pp > 1)."""
    loss: LossContext
    """How a loss reads the outputs (vocab-sharded logits, ops backend)."""
    autocast: torch.dtype | None
    """Compute dtype under torch.autocast (None: none; FSDP casts on its own)."""
    flops_per_token: int
    """Training FLOPs per token (MoE: the experts a token uses)."""
    router: LoadTracker | None = None
    """MoE models: expert loads of the step and the aux loss's bookkeeping."""


def model_config(model: ModelSection) -> TransformerConfig:
    """The model to build: from model.hf_path's config.json, model.hf_config, or a flavor."""
    own = {"ops_impl": model.ops_impl, "vocab_divisible_by": model.vocab_divisible_by,
           "router_aux_loss_scope": model.router_aux_loss_scope}  # fmt: skip
    if model.hf_path is not None:
        return read_hf_config(model.hf_path, **own)
    flavor = None if model.hf_config is not None else model.flavor
    return build_model_config(model.family, flavor, model.hf_config, **own)


def build_model(
    config: TransformerConfig,
    dims: ParallelDims,
    device: torch.device,
    *,
    parallel: ParallelConfig,
    precision: str = "fp32",
    ac: str = "none",
    seed: int = 1234,
    seq_len: int,
    hf_path: Path | None = None,
    before_tp: ModelHook | None = None,
    after_tp: ModelHook | None = None,
    frozen: bool = False,
    compile: str | bool = False,
    fp8: bool = False,
    cuda_graphs: bool = False,
) -> BuiltModel:
    """Build `config` on `device`, load `hf_path`'s weights, parallelise it on `dims`.

    Args:
        parallel: sequence/loss parallel, cp mode and pipeline options (degrees: `dims`).
        precision: "fp32", "bf16" or "fp16": FSDP's parameter dtype when sharded, else
            autocast's.
        ac: activation recompute per block ("none", "full", "selective").
        seed: each parameter is drawn from it and its name (each rank keeps its share),
            so every layout starts from one process's weights.
        seq_len: tokens per sample (for FLOPs).
        hf_path: a Hugging Face folder whose weights replace the drawn ones.
        before_tp: swap the head before anything is split (see `parallelize_decoder`).
        after_tp: inject adapters after TP, before CP/recompute/FSDP (LoRA).
        frozen: no gradients, eval mode, no recompute: a reference model.
        compile: torch.compile each block (after TP and recompute, before FSDP): "auto"
            (CUDA, NPU), "on", "off" or a bool (`train.compile.resolve_compile`).
        cuda_graphs: the compiled blocks replayed as CUDA graphs (`train.cuda_graphs`).
        fp8: torchao's float8 linear layers (not the head; not for a frozen model).
    """
    _check_offload(parallel, torch.device(device), "none" if frozen else ac)
    set_seed(seed, dims, vary_along=())
    spec = get_model_spec(config.family)
    model = build_meta(config)
    weights = None if hf_path is None else check_hf_weights(model, hf_path, config)
    base = base_shapes(model)
    flops = flops_per_token(active_params(model), config.num_layers, config.hidden_size, seq_len)
    dtype = DTYPES[precision]
    sharded = dims.fsdp_enabled or dims.dp_replicate > 1
    loss_parallel = dims.tp > 1 and parallel.loss_parallel
    options = _parallelize_options(parallel, dims, dtype, "none" if frozen else ac)
    options.update(loss_parallel=loss_parallel)
    options.update({k: v for k, v in (("before_tp", before_tp), ("after_tp", after_tp)) if v})
    mode = compile_mode(compile, cuda_graphs, device, config)
    if mode is not None:  # only when compiling: a family's parallelize may not know it
        options.update(compile=True if mode == "default" else mode)
    if fp8 and not frozen:
        options.update(fp8=True)
    if dims.pp > 1:
        pipeline = _pipeline(spec, model, dims, device, parallel, options)
        whole, parts = None, pipeline.model_parts
    else:
        pipeline, whole = None, spec.parallelize(model, dims, **options)
        parts = [whole]
    fill_parts(parts, device, seed=seed, weights=weights, base=base)
    if frozen:
        for part in parts:
            part.requires_grad_(False).eval()
    router = None
    if config.num_experts and not frozen:
        pp_mesh = dims.mesh("pp")
        router = LoadTracker(
            parts,
            config.router_bias_update_rate,
            pp_group=None if pp_mesh is None else pp_mesh.get_group(),
            num_experts=config.num_experts,
            device=device,
        )
    return BuiltModel(
        config=config,
        device=torch.device(device),
        model=whole,
        parts=parts,
        pipeline=pipeline,
        pipeline_schedule=parallel.pp_schedule if pipeline is not None else None,
        loss=LossContext(loss_parallel=loss_parallel, ops_impl=config.ops_impl),
        autocast=dtype if dtype != torch.float32 and not sharded else None,
        flops_per_token=flops,
        router=router,
    )


def _parallelize_options(parallel: ParallelConfig, dims, dtype, ac: str) -> dict:
    options = {
        "ac_mode": ac,
        "param_dtype": dtype if dtype != torch.float32 else None,
        "sequence_parallel": dims.tp > 1 and parallel.sequence_parallel,
    }
    if dims.cp > 1:
        options.update(cp_mode=parallel.cp_mode, ulysses_degree=parallel.ulysses_degree)
    if dims.ep > 1 and parallel.ep_dispatcher != "alltoall":
        options.update(ep_dispatcher=parallel.ep_dispatcher)
    options.update({k: True for k in ("activation_offload", "cpu_offload") if getattr(parallel, k)})
    return options


def _check_offload(parallel: ParallelConfig, device: torch.device, ac: str) -> None:
    """Offload moves tensors from an accelerator to the host: refused where there is none."""
    for name in ("activation_offload", "cpu_offload"):
        if getattr(parallel, name) and device.type == "cpu":
            raise ConfigError(
                f"parallel.{name}=true needs an accelerator: on CPU the host memory is the "
                "device memory, so there is nothing to offload to"
            )
    if parallel.activation_offload and ac != "none":
        raise ConfigError(
            f"parallel.activation_offload=true with train.ac={ac}: recompute already drops "
            "the activations offload would move; pick one"
        )


def _pipeline(spec, model, dims, device, parallel: ParallelConfig, options) -> PipelineParts:
    """This rank's stages (TP/AC/FSDP inside each)."""
    if spec.pipeline is None:
        raise ConfigError(f"model.family={spec.name} does not support parallel.pp > 1")
    return spec.pipeline(
        model,
        dims,
        device=device,
        schedule=parallel.pp_schedule,
        stages_per_rank=parallel.virtual_stages,
        layers_per_stage=parallel.layers_per_stage or None,
        **options,
    )


@dataclass
class TrainParts:
    """A trainable model and what steps it: optimizer, schedule, loss scaler, counters."""

    model: BuiltModel
    optimizer: OptimizersContainer
    scheduler: LRSchedulersContainer
    scaler: DynamicLossScaler | None
    state: TrainState = field(default_factory=TrainState)
    adapter_only: bool = False
    """Checkpoints hold only the trainable parameters (adapters; the frozen base is
    rebuilt from the run's model source)."""

    def states(self, data: Stateful | None, device: torch.device) -> dict[str, Stateful]:
        """Everything a checkpoint holds, under the names of the checkpoint layout."""
        states = {
            "model": ModelState(self.model.parts, trainable_only=self.adapter_only),
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "train": self.state,
        }
        if data is not None:
            states["data"] = data
        states["rng"] = RNGState(device)
        if self.scaler is not None:
            states["loss_scaler"] = self.scaler
        return states


def build_train_parts(
    model: BuiltModel,
    optim: OptimConfig,
    *,
    total_steps: int,
    precision: str = "fp32",
    adapter_only: bool = False,
) -> TrainParts:
    """The optimizers over `model`'s trainable parameters (`optim.name`), their LR schedule
    over `total_steps`, and a dynamic loss scaler for fp16; `adapter_only`: see `TrainParts`."""
    pp_group = model.pipeline.stages[0].group if model.pipeline is not None else None
    optimizer, scheduler = optim.build(model.parts, total_steps, pp_group=pp_group)
    scaler = DynamicLossScaler() if precision == "fp16" else None
    return TrainParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        adapter_only=adapter_only,
    )
