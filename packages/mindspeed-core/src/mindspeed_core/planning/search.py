"""Enumerate the layouts a job can run with, keep those that fit in memory, rank by time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from mindspeed_core.errors import MindSpeedError, ParallelError
from mindspeed_core.parallel.pipeline import check_pipeline
from mindspeed_core.planning.cost import Calibration, StepTime, estimate_step_time
from mindspeed_core.planning.memory import MemoryEstimate, estimate_memory
from mindspeed_core.planning.shape import AC_MODES, Job, Layout, ModelShape


class PlanError(MindSpeedError):
    """No layout can run the job (memory budget, device count, batch)."""


@dataclass(kw_only=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model_axes(shape: ModelShape, job: Job, devices: int, per_node: int):
    """(tp, pp, cp) triples the model and sequence allow."""
    for tp, pp, cp in itertools.product(divisors(devices), repeat=3):
        if tp * pp * cp > devices or devices % (tp * pp * cp):
            continue
        if tp > per_node or shape.num_heads % tp or shape.num_kv_heads % tp:
            continue
        if _tp_splits_mlps(shape) % tp:
            continue
        if pp > shape.num_layers or (pp > 1 and cp > 1):
            continue
        if job.seq_len % (2 * cp):
            continue
        yield tp, pp, cp


def enumerate_layouts(
    shape: ModelShape, job: Job, devices: int, *, devices_per_node: int | None = None,
    offload: bool = False,
) -> list[Layout]:  # fmt: skip
    """Every layout of `devices` ranks the model, the batch and our trainer allow."""
    per_node = devices_per_node or devices
    out = []
    for tp, pp, cp in _model_axes(shape, job, devices, per_node):
        dp = devices // (tp * pp * cp)
        for replicate, ac in itertools.product(divisors(dp), AC_MODES):
            for mb in _micro_batches(job, dp):
                if pp > 1 and not _pipeline_ok(shape, pp, job.global_batch // (mb * dp), ac):
                    continue
                for ep in _expert_degrees(shape, dp // replicate * cp, replicate):
                    for act, opt in _offloads(offload, ac, dp // replicate * cp):
                        out.append(Layout(
                            tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp // replicate,
                            dp_replicate=replicate, sequence_parallel=tp > 1,
                            loss_parallel=tp > 1, ac=ac, micro_batch=mb,
                            activation_offload=act, optimizer_offload=opt,
                        ))  # fmt: skip
    return out


def _micro_batches(job: Job, dp: int) -> list[int]:
    if job.global_batch % dp:
        return []
    per_rank = job.global_batch // dp
    return [m for m in divisors(per_rank) if m & (m - 1) == 0 or m == per_rank]


def _pipeline_ok(shape: ModelShape, pp: int, microbatches: int, ac: str) -> bool:
    try:
        check_pipeline(num_layers=shape.num_layers, pp=pp, stages_per_rank=1, schedule="1F1B",
                       n_microbatches=microbatches, recompute=ac != "none")  # fmt: skip
    except ParallelError:
        return False
    return microbatches >= pp


def _tp_splits_mlps(shape: ModelShape) -> int:
    """What tensor parallel must divide besides the heads: the dense MLP's width where some
    block is dense, the shared expert's where there is one (routed experts stay whole)."""
    widths = [shape.intermediate_size] if shape.num_moe_layers < shape.num_layers else []
    widths += [shape.shared_expert_intermediate_size] if shape.num_moe_layers else []
    return math.gcd(*widths) if widths else 0


def _expert_degrees(shape: ModelShape, shard_ranks: int, replicate: int) -> list[int]:
    """ep degrees: factors of dp_shard x cp that divide the experts (the trainer does not
    combine expert parallel with replicated data parallel)."""
    if not shape.num_experts or replicate > 1:
        return [1]
    return [e for e in divisors(shard_ranks) if shape.num_experts % e == 0]


def _offloads(enabled: bool, ac: str, fsdp: int) -> list[tuple[bool, bool]]:
    if not enabled:
        return [(False, False)]
    options = [(False, False), (False, True) if fsdp > 1 else (False, False)]
    if ac == "none":
        options += [(True, False)] + ([(True, True)] if fsdp > 1 else [])
    return sorted(set(options))


def plan(
    shape: ModelShape,
    job: Job,
    devices: int,
    memory_gb: float,
    *,
    calibration: Calibration | None = None,
    devices_per_node: int | None = None,
    offload: bool | None = None,
    accept: Callable[[Layout], bool] | None = None,
) -> list[Candidate]:
    """Layouts that fit `memory_gb` per device, fastest predicted first.

    Args:
        devices_per_node: tensor parallel stays inside a node; groups that span nodes
            move data at `calibration.inter_node_bandwidth`.
        accept: the trainer's own check of a layout against the model (e.g.
            `mindspeed_llm.models.common.layout.check_layout`); False drops it.

    Raises:
        PlanError: nothing fits (the message names the smallest layout and its need).
    """
    calib = calibration or Calibration.default(job.device)
    offload = job.device != "cpu" if offload is None else offload
    layouts = enumerate_layouts(shape, job, devices, devices_per_node=devices_per_node,
                                offload=offload)  # fmt: skip
    if accept is not None:
        layouts = [layout for layout in layouts if accept(layout)]
    if not layouts:
        raise PlanError(
            f"no layout of {devices} devices divides global batch {job.global_batch} and "
            f"sequence {job.seq_len} for this model"
        )
    budget = memory_gb * 2**30
    scored = [(layout, estimate_memory(shape, layout, job)) for layout in layouts]
    fitting = [
        Candidate(layout=lay, memory=mem,
                  time=estimate_step_time(shape, lay, job, calib, devices_per_node))  # fmt: skip
        for lay, mem in scored
        if mem.peak <= budget
    ]
    if not fitting:
        lay, mem = min(scored, key=lambda x: x[1].peak)
        raise PlanError(
            f"no layout of {devices} devices fits {memory_gb:g} GiB per device: the smallest "
            f"({lay.describe()}) needs {mem.peak / 2**30:.2f} GiB"
        )
    return sorted(fitting, key=lambda c: (c.time.total, c.memory.peak))
