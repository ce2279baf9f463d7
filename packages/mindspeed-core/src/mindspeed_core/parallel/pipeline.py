"""Pipeline parallel on `torch.distributed.pipelining`: split a plain model into stages.

torchtitan's approach: each stage is a copy of the model that keeps only what the stage
owns. Dropped top-level parts (``tok_embeddings``, ``norm``, ``output``) become None and
dropped blocks leave the ``layers`` ModuleDict, so every kept module keeps its name and a
DCP checkpoint saved with one pipeline layout loads into any other. The model's forward
must accept hidden states when its first part is None and return hidden states when its
last parts are None.

Which layers a stage gets:

- even split when the layers divide evenly over the stages;
- otherwise MindSpeed-LLM's ``--noop-layers`` idea, with the no-ops placed for the
  user: the model is padded to ``ceil(L / S) * S`` layers and each of the trailing
  stages gets one no-op layer at its end, i.e. the first ``L % S`` stages hold one
  real layer more than the rest (5 layers on 4 stages: 2, 1, 1, 1). A no-op layer
  costs nothing, so it is simply not built;
- or an explicit ``layers_per_stage`` list (e.g. ``[3, 1]``); only the first and the
  last stage may hold 0 layers (they still own the embeddings or the head).

Virtual stages: with ``stages_per_rank = v`` there are ``pp * v`` stages. Loop style
(Interleaved1F1B, InterleavedZeroBubble): rank r holds stages ``r, r + pp, ...``.
V style (ZBVZeroBubble, DualPipeV, exactly two per rank): rank r holds ``r`` and
``2 * pp - 1 - r``, so rank 0 holds both the first and the last stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from mindspeed_core.errors import ParallelError

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
_SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank
_V_STYLE = ("ZBVZeroBubble", "DualPipeV")  # exactly two stages per rank, V order
# Backward split into input-gradient and (later) weight-gradient steps.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stage_layer_counts(
    num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[int]:
    """Real layers of each stage (see the module docstring for the rules).

    Raises:
        ParallelError: more stages than layers, or a `layers_per_stage` of the wrong
            length or sum, or with an empty middle stage.
    """
    if layers_per_stage:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ParallelError(
                f"layers_per_stage={counts} has {len(counts)} entries but there are "
                f"{num_stages} pipeline stages (pp x virtual stages)"
            )
        if sum(counts) != num_layers or any(c < 0 for c in counts):
            raise ParallelError(
                f"layers_per_stage={counts} must be non-negative and sum to the model's "
                f"{num_layers} layers (it sums to {sum(counts)})"
            )
        empty = [i for i, c in enumerate(counts[1:-1], start=1) if c == 0]
        if empty:
            raise ParallelError(
                f"layers_per_stage={counts}: stage {empty[0]} would hold nothing; only the "
                "first and the last stage may have 0 layers"
            )
        return counts
    if num_stages > num_layers:
        raise ParallelError(
            f"{num_stages} pipeline stages (pp x virtual stages) but the model has only "
            f"{num_layers} layers; lower parallel.pp / parallel.virtual_stages"
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def stage_ids_this_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The global indices of the stages rank `pp_rank` holds, in execution order."""
    if schedule in _V_STYLE:
        assert stages_per_rank == 2
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def check_pipeline(
    *,
    num_layers: int,
    pp: int,
    stages_per_rank: int = 1,
    schedule: str = "1F1B",
    layers_per_stage: Sequence[int] | None = None,
    n_microbatches: int | None = None,
    recompute: bool = False,
) -> list[int]:
    """Validate a pipeline layout before any process group exists; returns layer counts.

    Args:
        recompute: the stages use activation checkpointing.

    Raises:
        ParallelError: an unknown schedule, a stage count the schedule cannot run,
            too few or badly divisible microbatches, a bad layer split, or recompute
            under a zero-bubble schedule.
    """
    _check_schedule_kind(schedule, stages_per_rank)
    if recompute and schedule in SPLIT_BACKWARD:
        raise ParallelError(
            f"schedule {schedule} computes weight gradients in a separate step, which "
            "activation checkpointing breaks (its recompute runs once); turn recompute off "
            "or use 1F1B / Interleaved1F1B"
        )
    num_stages = pp * stages_per_rank
    counts = stage_layer_counts(num_layers, num_stages, layers_per_stage)
    if n_microbatches is not None:
        check_microbatches(schedule, n_microbatches, pp, num_stages)
    return counts


def check_microbatches(schedule: str, n: int, pp: int, num_stages: int) -> None:
    """The microbatch counts torch's schedules accept, said in our terms and checked early.

    Raises:
        ParallelError: fewer microbatches than stages (1F1B, DualPipeV), or a count an
            interleaved schedule cannot group by pp.
    """
    if n < 1:
        raise ParallelError(f"pipeline microbatches={n} must be >= 1")
    if schedule in ("1F1B", "DualPipeV") and n < num_stages:
        raise ParallelError(
            f"schedule {schedule} needs at least as many microbatches as stages: "
            f"{n} microbatches, {num_stages} stages"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise ParallelError(
                f"schedule {schedule} with pp={pp} needs the microbatches ({n}) to be a "
                f"multiple of {rounds} (microbatches // pp); e.g. use a multiple of pp"
            )


@dataclass
class PipelineParts:
    """This rank's share of a pipelined model.

    Attributes:
        stages: torch `PipelineStage`s, in the order the schedule runs them.
        model_parts: their modules (what to parallelise, optimise and checkpoint).
        stage_ids: global stage index of each part.
        num_stages: stages over all ranks.
    """

    stages: list[PipelineStage]
    model_parts: list[nn.Module]
    stage_ids: list[int]
    num_stages: int

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def split_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    device: torch.device | str,
    stages_per_rank: int = 1,
    schedule: str = "1F1B",
    layers_per_stage: Sequence[int] | None = None,
    layer_prefix: str = "layers",
    first: Sequence[str] = ("tok_embeddings",),
    last: Sequence[str] = ("norm", "output"),
    tied: bool = False,
) -> PipelineParts:
    """This rank's stages of `model`, each a copy holding only what the stage owns.

    `model` is left untouched (free it afterwards). Build and initialise it whole with
    the run's seed first, and every layout starts from the same weights as one process.

    Args:
        model: a plain module with a ModuleDict `layer_prefix` and the top-level parts
            named in `first` (the first stage's) and `last` (the last stage's).
        pp_mesh: the 1-D pipeline mesh (``dims.mesh("pp")``).
        device: where the stages run (for torch's send/receive buffers).
        stages_per_rank: virtual stages per rank (2 for ZBVZeroBubble / DualPipeV).
        schedule: the schedule that will run the stages (decides loop or V order).
        layers_per_stage: layers of each of the ``pp * stages_per_rank`` stages.
        tied: parts of `first` and `last` may share parameters (tied embeddings): the
            first and the last stage each get a copy; keep them equal by summing their
            gradients (`mindspeed_core.parallel.TiedGrads`).

    Raises:
        ParallelError: see `check_pipeline`; or, without `tied`, a parameter shared
            between parts that end up on different stages.
    """
    layers = getattr(model, layer_prefix, None)
    if not isinstance(layers, nn.ModuleDict):
        raise ParallelError(f"{type(model).__name__}.{layer_prefix} must be an nn.ModuleDict")
    pp = pp_mesh.size()
    counts = check_pipeline(
        num_layers=len(layers),
        pp=pp,
        stages_per_rank=stages_per_rank,
        schedule=schedule,
        layers_per_stage=layers_per_stage,
    )
    ids = stage_ids_this_rank(pp_mesh.get_local_rank(), pp, stages_per_rank, schedule)
    parts = split_model(
        model, ids, counts, layer_prefix=layer_prefix, first=first, last=last, tied=tied
    )
    device = torch.device(device)
    stages = [
        PipelineStage(part, i, len(counts), device, group=pp_mesh.get_group())
        for part, i in zip(parts, ids, strict=True)
    ]
    return PipelineParts(stages, parts, ids, len(counts))


def split_model(
    model: nn.Module,
    stage_ids: Sequence[int],
    layer_counts: Sequence[int],
    *,
    layer_prefix: str = "layers",
    first: Sequence[str] = ("tok_embeddings",),
    last: Sequence[str] = ("norm", "output"),
    tied: bool = False,
) -> list[nn.Module]:
    """The modules of stages `stage_ids` when stage i holds `layer_counts[i]` layers.

    No process group needed: `split_pipeline` is this plus torch's `PipelineStage`s.

    Raises:
        ParallelError: without `tied`, a parameter shared between parts on different
            stages.
    """
    if not tied:
        _check_no_shared_params(model, first, last)
    names = list(getattr(model, layer_prefix).keys())
    assert sum(layer_counts) == len(names), (layer_counts, len(names))
    bounds = [sum(layer_counts[:i]) for i in range(len(layer_counts) + 1)]
    num_stages = len(layer_counts)
    parts = []
    for stage_id in stage_ids:
        keep = names[bounds[stage_id] : bounds[stage_id + 1]]
        drop = [*(first if stage_id > 0 else ()), *(last if stage_id < num_stages - 1 else ())]
        parts.append(_copy_owned(model, layer_prefix, keep, drop))
    return parts


def _copy_owned(model: nn.Module, prefix: str, keep: list[str], drop: list[str]) -> nn.Module:
    """A deep copy of `model` without `drop` and without the layers not in `keep`.

    Only the owned modules are copied: the others are taken out of `model` for the
    duration of the copy and put back.
    """
    layers = getattr(model, prefix)
    saved_layers = dict(layers.items())
    saved_parts = {name: getattr(model, name) for name in drop}
    try:
        for name in list(layers.keys()):
            if name not in keep:
                del layers[name]
        for name in drop:
            setattr(model, name, None)
        return copy.deepcopy(model)
    finally:
        for name in list(layers.keys()):
            del layers[name]
        layers.update(saved_layers)
        for name, module in saved_parts.items():
            setattr(model, name, module)


def _check_no_shared_params(model: nn.Module, first: Sequence[str], last: Sequence[str]) -> None:
    firsts = {
        id(p)
        for n in first
        if getattr(model, n, None) is not None
        for p in getattr(model, n).parameters()
    }
    for name in last:
        module = getattr(model, name, None)
        if module is not None and any(id(p) in firsts for p in module.parameters()):
            raise ParallelError(
                f"{name} shares weights with {', '.join(first)} (tied embeddings), but they "
                "belong to different pipeline stages; pass tied=True and sum their "
                "gradients (TiedGrads), untie them, or use pp=1"
            )


def build_pipeline_schedule(
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    schedule: str = "1F1B",
    *,
    scale_grads: bool = True,
):
    """A torch pipeline schedule over this rank's `stages`.

    With `scale_grads` (the default) `loss_fn(output, target)` is the mean loss of one
    microbatch and gradients are divided by `n_microbatches`, so one `step` gives the
    gradients of the mean loss over all microbatches, like gradient accumulation.
    Without it the gradients are the sum of what each microbatch's loss gives: for a
    `loss_fn` already normalised over the whole step (e.g. by its token count).

    Raises:
        ParallelError: see `check_pipeline`.
    """
    stages = list(stages)
    if not stages:
        raise ParallelError("build_pipeline_schedule needs at least one stage")
    _check_schedule_kind(schedule, len(stages))
    check_microbatches(schedule, n_microbatches, stages[0].group_size, stages[0].num_stages)
    cls = SCHEDULES[schedule]
    if schedule in _SINGLE_STAGE:
        return cls(
            stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
        )
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def _check_schedule_kind(schedule: str, stages_per_rank: int) -> None:
    if schedule not in SCHEDULES:
        raise ParallelError(f"pipeline schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if stages_per_rank < 1:
        raise ParallelError(f"virtual stages per rank={stages_per_rank} must be >= 1")
    if schedule in _SINGLE_STAGE and stages_per_rank != 1:
        raise ParallelError(
            f"schedule {schedule} runs one stage per rank, not {stages_per_rank} virtual "
            "stages; use Interleaved1F1B or InterleavedZeroBubble for virtual stages"
        )
    if schedule in _V_STYLE and stages_per_rank != 2:
        raise ParallelError(
            f"schedule {schedule} needs exactly 2 virtual stages per rank, got {stages_per_rank}"
        )
