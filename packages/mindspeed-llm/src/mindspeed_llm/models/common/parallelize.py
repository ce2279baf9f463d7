"""Parallelise a `Transformer` (dense or MoE) from outside: (pipeline split) -> TP -> EP ->
CP -> activation checkpointing -> FSDP/DDP, with two hooks for trainers: `before_tp` (swap
the head) and `after_tp` (inject adapters such as LoRA).

The order is torchtitan's: tensor parallel first (DTensor plans on whole modules), then
recompute wrappers on each block, then data parallel, which shards whatever parameters
(plain or already TP-sharded DTensors) it finds.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.fp8 import convert_fp8, float8_plan
from mindspeed_core.memory import offload_activations
from mindspeed_core.parallel import (
    ParallelDims,
    PipelineParts,
    TiedGrads,
    apply_ac,
    apply_compile,
    apply_cp,
    apply_ddp,
    apply_ep,
    apply_expert_fsdp,
    apply_fsdp,
    apply_tp,
    pipeline_ends_group,
    split_pipeline,
)
from mindspeed_llm.models.common.gated_deltanet import GatedDeltaNet
from mindspeed_llm.models.common.layout import check_layout, layout_of
from mindspeed_llm.models.common.moe import MoE
from mindspeed_llm.models.common.tp_plan import (
    LATENT_REPLICATED,
    llama_tp_plan,
    with_latent_attention,
    with_moe_layers,
    with_mtp_blocks,
)
from mindspeed_ops import attention, attention_backward

ModelHook = Callable[[nn.Module, ParallelDims], "set[nn.Parameter] | None"]
"""`hook(model, dims)`: changes `model` in place at a fixed point of the parallelize order;
an `after_tp` hook may return parameters FSDP must leave whole (QLoRA's base, quantised
once the model is materialised)."""


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
    compile: bool | str = False,
    fp8: bool = False,
    ep_dispatcher: str = "alltoall",
    before_tp: ModelHook | None = None,
    after_tp: ModelHook | None = None,
    data_parallel: bool = True,
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
        fp8: torchao's float8 training for the linear layers but the output head
            (`mindspeed_core.fp8.convert_fp8`), after `before_tp`; under tensor parallel with
            torchao's float8 styles (`mindspeed_core.fp8.float8_plan`; dense attention models).
        ep_dispatcher: how expert parallel (ep > 1) moves tokens: "alltoall" or
            "allgather" (see `mindspeed_core.parallel.apply_ep`).
        before_tp: called on the whole, still plain model first: the place to swap the
            head, e.g. `model.output = nn.Linear(hidden, 1)` for a reward model or critic.
            Under `train.build.build_model` both hooks run on the meta device: they change
            the model's structure; values come when it is materialised (`nn.Linear` and
            `nn.Embedding` by torch's rules, any other module by its `init_params(init)`).
            A head that is not vocabulary-sized stays replicated under TP (its input is
            gathered), so it needs `loss_parallel=False`.
        after_tp: called after tensor parallel and before expert parallel, context
            parallel, recompute and FSDP: the place to inject adapters (LoRA). Here the
            TP-planned weights are already DTensors whose placements the adapter can
            copy, and FSDP will shard (and gather) whatever parameters it then finds;
            before TP would not work, because torch's ColwiseParallel shards every
            parameter under a planned module, an adapter's included, along dim 0.
        data_parallel: False leaves out the DDP/FSDP wrapper: each data-parallel group
            runs forwards of its own (evaluation, serving), with no collective tying them.

    Raises:
        LayoutError: a layout `check_layout` refuses (see `models.common.layout`); a
            pipeline stage (pp > 1) is not checked again: `pipeline_decoder` checked the
            whole model.
        ParallelError: a whole model under pp > 1 (see `pipeline_decoder`), or options
            that need tensor parallel without it.
    """
    if fp8 and dims.tp > 1 and (model.config.num_experts or model.config.kv_lora_rank is not None
                                or model.config.linear_attention_layers):  # fmt: skip
        raise ConfigError(
            f"train.fp8 with parallel.tp={dims.tp}: fp8 linear layers under tensor parallel "
            "are built for dense attention models only (not MoE, latent or linear attention; "
            "set parallel.tp=1)"
        )
    if dims.pp > 1 and None not in (model.tok_embeddings, model.output):
        raise ParallelError(
            f"pp={dims.pp}: split the model into stages with pipeline_decoder, not parallelize_decoder"
        )
    if dims.pp == 1:  # a pipeline stage was checked whole by pipeline_decoder
        layout = layout_of(dims, cp_mode=cp_mode, ulysses_degree=ulysses_degree)
        check_layout(model.config, layout, flag="{}")
    if before_tp is not None:
        before_tp(model, dims)
    if fp8:
        convert_fp8(model)
    if dims.tp == 1 and (sequence_parallel or loss_parallel):
        raise ParallelError("sequence_parallel and loss_parallel need tp > 1")
    if dims.tp > 1:
        _tensor_parallel(model, dims.mesh("tp"), sequence_parallel, loss_parallel, fp8)
    kept_whole = (after_tp(model, dims) if after_tp is not None else None) or set()
    ignored_by_fsdp = kept_whole | _expert_parallel(
        model, dims, param_dtype, reduce_dtype, ep_dispatcher
    )
    _route_over_cp(model, dims)
    impl = model.config.ops_impl
    apply_cp(model, dims.mesh("cp"), mode=cp_mode, ulysses_degree=ulysses_degree,
             attention_fn=functools.partial(attention, impl=impl),
             attention_bwd_fn=functools.partial(attention_backward, impl=impl))  # fmt: skip
    apply_ac(model, ac_mode)
    if compile:  # under cp the attention runs eagerly between a block's two graphs
        mode = compile if isinstance(compile, str) else None  # "reduce-overhead": CUDA graphs
        apply_compile(model, fullgraph=dims.cp == 1, varying={"cu_seqlens": 0}, mode=mode)
    if not data_parallel:
        return model
    if cpu_offload and not dims.fsdp_enabled:
        raise ParallelError("cpu_offload (optimizer-state offload) needs FSDP: dp_shard x cp > 1")
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            ignored_params=ignored_by_fsdp,
            cpu_offload=cpu_offload,
        )
    else:
        apply_ddp(
            model, dims.mesh("dp_replicate"), param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    if activation_offload:  # last: FSDP's hooks must gather parameters before it looks
        offload_activations(model)
    return model


_POST_NORMS = ("post_attention_norm", "post_ffn_norm")
_MTP_NORMS = ("enorm", "hnorm", "norm")


def _tensor_parallel(model, tp_mesh, sequence_parallel: bool, loss_parallel: bool,
                     fp8: bool = False) -> None:  # fmt: skip
    config = model.config
    plan = llama_tp_plan(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        tp=tp_mesh.size(),
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
    )
    if config.kv_lora_rank is not None:
        plan = with_latent_attention(plan)
    if sequence_parallel and config.post_norms:  # Gemma 2's output norms see sequence shards
        plan.update({f"layers.*.{n}": SequenceParallel(use_local_output=True) for n in _POST_NORMS})
    blocks = _blocks(model)  # the MTP modules' blocks planned as if in `layers`
    moe = [k for k, layer in blocks.items() if isinstance(layer.feed_forward, MoE)]
    if moe:
        dense = [k for k in blocks if k not in moe]
        plan = with_moe_layers(
            plan, moe, dense, sequence_parallel=sequence_parallel,
            shared_expert=bool(config.shared_expert_intermediate_size),
        )  # fmt: skip
    if getattr(model, "mtp", None) is not None:
        plan = with_mtp_blocks(plan, list(model.mtp.layers))
        if sequence_parallel:  # the MTP modules' norms see sequence shards, as the decoder's
            plan.update({f"mtp.layers.*.{n}": SequenceParallel() for n in _MTP_NORMS})
    head = getattr(model, "output", None)
    pad_vocabulary(model, tp_mesh.size())
    config = model.config
    if head is not None and getattr(head, "out_features", config.num_rows) != config.num_rows:
        if loss_parallel:
            raise ParallelError("loss_parallel needs the vocabulary head; this model's was swapped")
        # A small head (a value head) is not worth sharding: gather its input, keep it whole.
        seq = Shard(1) if sequence_parallel else Replicate()
        plan["output"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if config.linear_attention_layers:
        plan.update(_linear_attention_plan(model, sequence_parallel))
    if fp8:  # the converted layers take torchao's float8 styles
        plan = float8_plan(plan, model)
    apply_tp(model, tp_mesh, _owned_entries(plan, model))
    tie_embeddings(model)
    if config.linear_attention_layers:
        _shard_linear_attention(model, tp_mesh)
    if config.qk_norm and config.qk_norm_scope == "all":
        _shard_qk_norms(model, tp_mesh)
    elif config.qk_norm:
        _replicate_qk_norms(model, tp_mesh)
    if config.attention_sinks:
        _shard_sinks(model, tp_mesh)
    if config.kv_lora_rank is not None:
        _replicate_latent_parts(model, tp_mesh)
    if sequence_parallel and getattr(model, "mtp", None) is not None:
        _replicate_mtp_projections(model, tp_mesh)
    if config.index_topk:
        for layer in _blocks(model).values():  # DSA's indexer: whole on every rank
            distribute_module(layer.attention.indexer, tp_mesh)
            layer.attention.tp_group = tp_mesh.get_group()


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder blocks by layer number: `layers`, then the MTP modules' blocks."""
    blocks = dict(model.layers.items())
    if getattr(model, "mtp", None) is not None:
        blocks.update({i: layer.block for i, layer in model.mtp.layers.items()})
    return blocks


def _vocab_matrices(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, "weight") of the embedding and of a vocabulary-sized output this model
    (or pipeline stage) holds."""
    rows = model.config.num_rows
    found = []
    for name in ("tok_embeddings", "output"):
        module = getattr(model, name, None)
        if module is not None and module.weight.shape[0] == rows:
            found.append((module, "weight"))
    return found


@torch.no_grad()
def pad_vocabulary(model: nn.Module, tp: int) -> None:
    """Append zero rows to the embedding and the output projection up to
    `config.padded_vocab(tp)` (Megatron's padding) and record it in `model.config`; tied
    matrices stay one parameter. The model's forward hides the padding again."""
    config = model.config
    rows = config.padded_vocab(tp)
    matrices = _vocab_matrices(model)
    if rows <= config.num_rows or not matrices:
        return
    padded: dict[int, nn.Parameter] = {}
    for module, name in matrices:
        weight = getattr(module, name)
        if id(weight) not in padded:
            extra = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
            new = nn.Parameter(torch.cat([weight, extra]), requires_grad=weight.requires_grad)
            padded[id(weight)] = new
        setattr(module, name, padded[id(weight)])
        if isinstance(module, nn.Embedding):
            module.num_embeddings = rows
        else:
            module.out_features = rows
    model.config = replace(config, padded_vocab_size=rows)


def tie_embeddings(model: nn.Module) -> None:
    """Tied embeddings: tensor parallel shards the embedding and the output projection
    alike (vocab rows, Shard(0)) but as two parameters; make them one again."""
    tok, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if not model.config.tie_word_embeddings or tok is None or head is None:
        return
    if head.weight is not tok.weight and head.weight.shape == tok.weight.shape:
        head.weight = tok.weight


def pipeline_decoder(
    model: nn.Module,
    dims: ParallelDims,
    *,
    device: torch.device | str,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    layers_per_stage: Sequence[int] | None = None,
    before_tp: ModelHook | None = None,
    after_tp: ModelHook | None = None,
    **options,
) -> PipelineParts:
    """This rank's pipeline stages of `model`, each parallelised like a whole model.

    torchtitan's order: split first (`split_pipeline`: each stage a copy holding its own
    layers under their original names), then TP -> AC -> FSDP/DDP on every stage with
    the options of `parallelize_decoder`. Build `model` on the meta device and
    materialise the stages after (`models.startup.fill_parts`): each draws or reads its
    own layers, as one process would.

    Args:
        before_tp: called once on the whole model, before the split (a swapped head then
            lands on the last stage); see `parallelize_decoder`.
        after_tp: called on every stage after its tensor parallel; see
            `parallelize_decoder`.

    Raises:
        ParallelError: pp=1; LayoutError: a layout `check_layout` refuses (tied
            embeddings, a split or schedule `check_pipeline` refuses, recompute under
            zero-bubble schedules).
    """
    if dims.pp == 1:
        raise ParallelError("pipeline_decoder needs pp > 1; use parallelize_decoder")
    layout = layout_of(dims, **options)
    layout.pp_schedule, layout.virtual_stages = schedule, stages_per_rank
    layout.layers_per_stage = list(layers_per_stage or [])
    ac_mode = options.get("ac_mode", "none")
    check_layout(model.config, layout, recompute=ac_mode != "none", flag="{}")
    if before_tp is not None:
        before_tp(model, dims)
    parts = split_pipeline(
        model,
        dims.mesh("pp"),
        device=device,
        stages_per_rank=stages_per_rank,
        schedule=schedule,
        layers_per_stage=layers_per_stage,
        last=("norm", "output", "mtp"),  # MTP modules after the last block; see Transformer
        tied=model.config.tie_word_embeddings,
    )
    for part in parts.model_parts:
        parallelize_decoder(part, dims, after_tp=after_tp, **options)
        for block in part.modules():
            if isinstance(block, MoE):  # the step cannot see other stages' router statistics
                block.attach_aux = True
    return parts


def tied_embedding_grads(parts: Sequence[nn.Module], dims: ParallelDims) -> TiedGrads | None:
    """Under pp > 1 with tied embeddings: the gradient sum of the first stage's embedding
    and the last stage's output projection (`mindspeed_core.parallel.TiedGrads`), for the
    trainer to call after backward; None otherwise. Collective: every rank calls it."""
    if dims.pp == 1 or not parts or not parts[0].config.tie_word_embeddings:
        return None
    group = pipeline_ends_group(dims)
    first = next((p.tok_embeddings.weight for p in parts if p.tok_embeddings is not None), None)
    last = next((p.output.weight for p in parts if p.output is not None), None)
    return TiedGrads(first, last, group)


def _owned_entries(plan: dict, model: nn.Module) -> dict:
    """The plan entries naming submodules `model` has (a pipeline stage lacks some)."""
    names = [n for n, _ in model.named_modules() if n]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}


def _route_over_cp(model: nn.Module, dims: ParallelDims) -> None:
    """Context parallel: each MoE block's load-balancing loss sums the loads over cp, and
    the MTP modules look up the tokens ahead over cp (`common.mtp`)."""
    if dims.cp == 1:
        return
    if getattr(model, "mtp", None) is not None:
        model.mtp.cp_group = dims.mesh("cp").get_group()
    for block in model.modules():
        if isinstance(block, MoE):
            block.token_group = dims.mesh("cp").get_group()


def _expert_parallel(
    model: nn.Module, dims: ParallelDims, param_dtype, reduce_dtype, dispatcher: str
) -> set[nn.Parameter]:
    """Experts over `ep` (all-to-all or all-gather), their own FSDP over
    `dp_shard_mod_ep`; returns the expert parameters the model-wide FSDP must leave alone."""
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    if dims.ep == 1:
        return set()
    apply_ep(experts, dims.mesh("ep"), dispatcher=dispatcher)
    return apply_expert_fsdp(
        experts,
        dims.mesh("dp_shard_mod_ep"),
        grad_divide_factor=dims.degree("dp_shard_cp"),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )


def _replicate_latent_parts(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Multi-head latent attention's low-rank parts as replicated DTensors over the tp mesh:
    they run on the gathered input and feed column-parallel layers, whose input gradients
    come back summed, so every rank holds their whole gradient."""
    for layer in _blocks(model).values():
        for name in LATENT_REPLICATED:
            module = getattr(layer.attention, name, None)
            if module is not None:
                distribute_module(module, tp_mesh)


def _replicate_mtp_projections(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sequence parallel: each MTP module's eh_proj as a replicated DTensor on the sequence
    shards its norms give (its weight's gradient summed over the tp ranks), handing its
    block the local shard, as the decoder's blocks take their input."""
    for layer in model.mtp.layers.values():
        distribute_module(layer.eh_proj, tp_mesh, output_fn=lambda _m, out, _mesh: out.to_local())


def _shard_sinks(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Attention sinks (one logit per query head) as DTensors sharded by head over the tp
    mesh, like wq's rows: each rank's attention reads its own heads' sinks."""
    for layer in _blocks(model).values():
        attention = layer.attention
        attention.sinks = nn.Parameter(distribute_tensor(attention.sinks.data, tp_mesh, [Shard(0)]))


def _shard_qk_norms(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """qk_norm_scope="all": each tp rank normalises its heads' share of the q/k width, so
    the norm weights are sharded like wq's and wk's rows, and the attention sums the squares
    over the tp ranks (`norm.rms_norm_over_ranks`)."""
    for layer in _blocks(model).values():
        attention = layer.attention
        for norm in (attention.q_norm, attention.k_norm):
            weight = distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)])
            norm.weight = nn.Parameter(weight, requires_grad=norm.weight.requires_grad)
        attention.qk_norm_group = tp_mesh.get_group()


def _linear_attention_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """Gated DeltaNet blocks: their projections split by key-head group (the checkpoints'
    grouping: each group's q, k, v, z rows and b, a rows are contiguous), out_proj by row."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for name, layer in model.layers.items():
        if isinstance(layer.attention, GatedDeltaNet):
            prefix = f"layers.{name}.attention"
            plan[f"{prefix}.in_proj_qkvz"] = ColwiseParallel()
            plan[f"{prefix}.in_proj_ba"] = ColwiseParallel()
            plan[f"{prefix}.out_proj"] = RowwiseParallel(output_layouts=seq)
    return plan


def _shard_linear_attention(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The rest of a gated DeltaNet block under tp: the convolution's channels (grouped per
    key head), dt_bias and A_log (per value head) sharded like the projections' rows; the
    gated norm's weight, shared by every head, replicated (its gradient summed over ranks)."""
    for layer in _blocks(model).values():
        mixer = layer.attention
        if not isinstance(mixer, GatedDeltaNet):
            continue
        for name in ("conv_weight", "dt_bias", "A_log"):
            param = getattr(mixer, name)
            sharded = distribute_tensor(param.detach(), tp_mesh, [Shard(0)])
            setattr(mixer, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        distribute_module(mixer.norm, tp_mesh)


def _replicate_qk_norms(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the per-head q/k norm weights replicated DTensors over the tp mesh.

    Each rank normalises only its own heads, so each sees part of the weights' gradient;
    as DTensors, `RMSNorm` marks that gradient Partial and DTensor sums it over ranks.
    """
    for layer in _blocks(model).values():
        if getattr(layer.attention, "q_norm", None) is None:
            continue  # a gated DeltaNet block
        distribute_module(layer.attention.q_norm, tp_mesh)
        distribute_module(layer.attention.k_norm, tp_mesh)
