"""The one check of a parallel layout against a model, before any process group exists.

Three callers, one set of rules:
- the trainers, on their `parallel` section (messages name `parallel.<field>`, and they
  run before the first process group, so a bad layout costs nothing);
- `parallelize_decoder` / `pipeline_decoder`, for embedders calling them directly
  (messages name the bare degree, `tp=2`);
- `mindspeed convert --tp/--pp/--ep` (messages name `--tp`), which records a layout the
  trainer will accept.

`LayoutError` is both a `ConfigError` and a `ParallelError`, so each caller's documented
error type holds.
"""

from __future__ import annotations

from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.parallel import ParallelConfig, ParallelDims, check_pipeline, cp_degrees
from mindspeed_core.parallel.context_parallel import check_cp_heads
from mindspeed_llm.models.config import TransformerConfig

__all__ = ["LayoutError", "check_layout", "layout_of"]


class LayoutError(ConfigError, ParallelError):
    """A parallel layout this model cannot be built or trained under."""


def check_layout(
    model_cfg: TransformerConfig,
    parallel: ParallelConfig,
    *,
    seq_len: int | None = None,
    recompute: bool = False,
    flag: str = "parallel.{}",
) -> list[int] | None:
    """Refuse a layout of `model_cfg` we do not build; returns the layers of each pipeline
    stage (None when pp=1).

    Args:
        parallel: the degrees and their options (pipeline schedule, cp mode ...).
        seq_len: tokens per sample, when known (context parallel cuts it into 2 x cp).
        recompute: activation checkpointing is on (zero-bubble schedules refuse it).
        flag: how messages spell a field: "parallel.{}" (config), "--{}" (a CLI), "{}".

    Raises:
        LayoutError: the field, its value and the model size it does not fit.
    """
    name = flag.format
    _check_degrees(parallel, name)
    _check_experts(model_cfg, parallel, name)
    _check_latent_attention(model_cfg, parallel, name)
    _check_tensor_parallel(model_cfg, parallel.tp, name)
    _check_context_parallel(model_cfg, parallel, seq_len, name)
    return _check_pipeline(model_cfg, parallel, recompute, name)


def layout_of(dims: ParallelDims, **options) -> ParallelConfig:
    """The `ParallelConfig` of built `dims` plus parallelize options (cp_mode, ulysses_degree,
    sequence_parallel, loss_parallel), for `check_layout`."""
    keys = ("cp_mode", "ulysses_degree", "sequence_parallel", "loss_parallel")
    chosen = {k: options[k] for k in keys if options.get(k) is not None}
    degrees = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate")
    return ParallelConfig(**{d: getattr(dims, d) for d in degrees}, **chosen)


def _check_degrees(p: ParallelConfig, name) -> None:
    for field in ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard"):
        value = getattr(p, field)
        if not isinstance(value, int) or (value < 1 and not (field == "dp_shard" and value == -1)):
            raise LayoutError(f"{name(field)}={value} must be >= 1")


def _check_experts(model_cfg: TransformerConfig, p: ParallelConfig, name) -> None:
    num_experts = model_cfg.num_experts
    if p.ep > 1 and not num_experts:
        raise LayoutError(
            f"{name('ep')}={p.ep} needs a MoE model; model.family={model_cfg.family} has no experts"
        )
    if num_experts % p.ep:
        raise LayoutError(f"{name('ep')}={p.ep} must divide the model's num_experts={num_experts}")
    num_moe_layers = sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.num_layers))
    pooled = model_cfg.router_aux_loss_coef and model_cfg.router_aux_loss_scope == "model"
    if p.pp > 1 and pooled and num_moe_layers > 1:
        raise LayoutError(
            f"{name('pp')}={p.pp}: the load-balancing loss pooled over all MoE layers "
            "(model.router_aux_loss_scope=model) needs every layer's loads on one stage; "
            "set model.router_aux_loss_scope=layer (each layer's own loss) or "
            "model.router_aux_loss_coef=0"
        )
    if p.cp > 1 and num_experts and model_cfg.capacity_factor is not None:
        raise LayoutError(
            f"{name('cp')}={p.cp}: capacity_factor={model_cfg.capacity_factor} drops tokens per "
            "rank's share of a sequence, unlike one process; use dropless routing "
            "(capacity_factor=None) with context parallel"
        )
    if p.ep > 1 and p.dp_replicate > 1:
        raise LayoutError(
            f"{name('ep')}={p.ep} with {name('dp_replicate')}={p.dp_replicate} is not supported yet"
        )


def _check_latent_attention(model_cfg: TransformerConfig, p: ParallelConfig, name) -> None:
    """Multi-head latent attention splits its heads over tp (MTP modules run under every
    layout: `common.mtp`)."""
    if model_cfg.kv_lora_rank is not None and p.tp > 1 and model_cfg.num_heads % p.tp:
        raise LayoutError(
            f"{name('tp')}={p.tp} must divide num_heads={model_cfg.num_heads} "
            "(multi-head latent attention splits its heads)"
        )


def _check_tensor_parallel(model_cfg: TransformerConfig, tp: int, name) -> None:
    if tp == 1:
        return
    if model_cfg.linear_attention_layers and model_cfg.linear_num_key_heads % tp:
        raise LayoutError(
            f"{name('tp')}={tp} does not divide linear_num_key_heads="
            f"{model_cfg.linear_num_key_heads}: gated DeltaNet blocks split by key-head group"
        )
    moe = [
        bool(model_cfg.num_experts) and model_cfg.is_moe_layer(i)
        for i in range(model_cfg.num_layers)
    ]
    fields = ["num_heads", "num_kv_heads"]  # the vocabulary is padded (vocab_divisible_by)
    fields += ["intermediate_size"] if not all(moe) else []  # some dense feed-forward
    # routed experts stay whole under tp (expert parallel shards them); shared experts split
    fields += ["shared_expert_intermediate_size"] if any(moe) else []
    for field in fields:
        if getattr(model_cfg, field) % tp:
            raise LayoutError(
                f"{name('tp')}={tp} does not divide {field}={getattr(model_cfg, field)} of this model"
            )


def _check_context_parallel(model_cfg, p: ParallelConfig, seq_len: int | None, name) -> None:
    if p.cp == 1:
        return
    if p.pp > 1:
        raise LayoutError(f"{name('cp')}={p.cp} with {name('pp')}={p.pp} is not supported yet")
    if model_cfg.index_topk:
        raise LayoutError(
            f"{name('cp')}={p.cp}: DeepSeek sparse attention (index_topk) under context parallel "
            "is not built yet"
        )
    if model_cfg.linear_attention_layers and p.cp_mode == "hybrid":
        raise LayoutError(
            f"{name('cp_mode')}=hybrid with gated DeltaNet (linear attention) blocks: their state "
            "passes along one cp group (ring or ulysses)"
        )
    if seq_len is not None and seq_len % (2 * p.cp):
        raise LayoutError(
            f"data.seq_len={seq_len} is not divisible by 2 x {name('cp')} = {2 * p.cp}: "
            "context parallel cuts every sequence into 2 x cp zig-zag chunks"
        )
    try:
        _, ulysses = cp_degrees(p.cp, p.cp_mode, p.ulysses_degree)
        heads, kv_heads = model_cfg.num_heads // p.tp, max(model_cfg.num_kv_heads // p.tp, 1)
        check_cp_heads(heads, kv_heads, ulysses)
    except ParallelError as err:
        raise LayoutError(
            f"{name('cp_mode')}={p.cp_mode} with {name('cp')}={p.cp}: {err}"
        ) from None


def _check_pipeline(model_cfg, p: ParallelConfig, recompute: bool, name):
    if p.pp == 1:
        for field, value, default in (
            ("virtual_stages", p.virtual_stages, 1),
            ("layers_per_stage", p.layers_per_stage, []),
            ("pp_microbatches", p.pp_microbatches, None),
        ):
            if value != default:
                raise LayoutError(f"{name(field)}={value} needs {name('pp')} > 1")
        return None
    try:
        return check_pipeline(
            num_layers=model_cfg.num_layers,
            pp=p.pp,
            stages_per_rank=p.virtual_stages,
            schedule=p.pp_schedule,
            layers_per_stage=p.layers_per_stage or None,
            recompute=recompute,
        )
    except ParallelError as err:
        raise LayoutError(f"{name('pp')}={p.pp}: {err}") from None
