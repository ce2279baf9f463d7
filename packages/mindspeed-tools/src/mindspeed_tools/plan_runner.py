"""Run a few training steps of one layout directly through core's pieces, on this rank.

Used by `mindspeed plan --calibrate` (step times) and by the tests that hold the memory
estimator and the planner against measured runs. Random tokens, one document per row
(packed with `cu_seqlens`, as the trainer feeds them), AdamW; no data pipeline and no run
directory. Call it on every rank of a process group whose size is the layout's world size.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mindspeed_ops
from mindspeed_core import device as dev
from mindspeed_core.optim import build_optimizers
from mindspeed_core.parallel import (
    ParallelDims,
    build_pipeline_schedule,
    gather_tokens,
    loss_parallel_context,
    packed_shard_index,
)
from mindspeed_core.planning import Job, Layout
from mindspeed_core.planning.measure import PeakProbe
from mindspeed_llm.models import TransformerConfig, get_model_spec

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Run:
    dims: ParallelDims
    parts: list
    model: torch.nn.Module | None
    schedule: object | None
    optimizer: object
    accum: int


def _build(config: TransformerConfig, layout: Layout, job: Job, device, seed: int,
           alone: bool = False) -> _Run:  # fmt: skip
    dims = ParallelDims(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                        dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate,
                        world_size=layout.world_size if alone else None).build()  # fmt: skip
    torch.manual_seed(seed)
    spec = get_model_spec(config.family)
    with torch.device(device):
        model = spec.build(config)
    dtype = _DTYPES[job.precision]
    options = {
        "ac_mode": layout.ac,
        "param_dtype": None if dtype == torch.float32 else dtype,
        "sequence_parallel": layout.sequence_parallel and layout.tp > 1,
        "loss_parallel": layout.loss_parallel and layout.tp > 1,
    }
    accum = job.grad_accum(layout)
    schedule = None
    if layout.pp > 1:
        pipe = spec.pipeline(model, dims, device=device, schedule=layout.pp_schedule,
                             stages_per_rank=layout.virtual_stages, **options)  # fmt: skip
        parts, model = pipe.model_parts, None
        schedule = build_pipeline_schedule(pipe.stages, accum, _loss, layout.pp_schedule)
    else:
        model = spec.parallelize(model, dims, **options)
        parts = [model]
    if layout.activation_offload:
        from mindspeed_core.memory import offload_activations

        for part in parts:
            offload_activations(part, allow_cpu=device.type == "cpu")
    optimizer = build_optimizers(parts, lr=1e-4, weight_decay=0.1)
    return _Run(dims, parts, model, schedule, optimizer, accum)


def _loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if hasattr(logits, "full_tensor"):  # loss parallel: vocab-sharded DTensor logits
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction
        )
    return mindspeed_ops.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)


def _batches(config, layout: Layout, job: Job, run: _Run, step: int) -> list[torch.Tensor]:
    """This rank's micro-batches of (micro_batch, seq + 1) tokens for `step`."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, config.vocab_size, (job.global_batch, job.seq_len + 1), generator=gen)
    mine = data.chunk(run.dims.dp)[run.dims.rank("dp")]
    return list(mine.chunk(run.accum))


def _micro_step(run: _Run, layout: Layout, batch: torch.Tensor, device) -> None:
    tokens, labels = batch[:, :-1].to(device), batch[:, 1:].to(device)
    rows, seq = tokens.shape
    cu = torch.arange(0, rows * seq + 1, seq, dtype=torch.int32, device=device)
    positions = torch.arange(seq, device=device).repeat(rows, 1)
    with loss_parallel_context(layout.loss_parallel and layout.tp > 1):
        if run.dims.cp > 1:
            index, local_cu = packed_shard_index(cu, run.dims.rank("cp"), run.dims.cp)
            local = [gather_tokens(t.flatten(), index, pad)[None]
                     for t, pad in ((tokens, 0), (labels, -100), (positions, 0))]  # fmt: skip
            logits = run.model(local[0], position_ids=local[2], cu_seqlens=local_cu)
            loss = _loss(logits, local[1], "sum") * run.dims.cp / labels.numel()
        else:
            logits = run.model(tokens, position_ids=positions, cu_seqlens=cu)
            loss = _loss(logits, labels)
        del logits
        (loss / run.accum).backward()


def _step(run: _Run, config, layout: Layout, job: Job, step: int, device) -> None:
    batches = _batches(config, layout, job, run, step)
    if run.schedule is not None:
        batch = torch.cat(batches).to(device)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        rows, seq = batches[0].shape[0], job.seq_len
        cu = torch.arange(0, rows * seq + 1, seq, dtype=torch.int32, device=device)
        positions = torch.arange(seq, device=device).repeat(rows, 1)
        run.schedule.step(
            arg_mbs=[(t,) for t in tokens.chunk(run.accum)],
            kwarg_mbs=[{"position_ids": positions, "cu_seqlens": cu}] * run.accum,
            target_mbs=list(labels.chunk(run.accum)),
            losses=[],
            return_outputs=False,
        )
    else:
        for batch in batches:
            _micro_step(run, layout, batch, device)
    run.optimizer.step()
    run.optimizer.zero_grad()


def run_layout(
    config: TransformerConfig,
    layout: Layout,
    job: Job,
    *,
    steps: int = 3,
    measure_memory: bool = True,
    seed: int = 0,
    alone: bool = False,
) -> dict:
    """Train `steps` steps; this rank's {"peak_bytes": of the last step (after one step
    made the optimizer states), "step_s": [wall time of each step after the first]}.
    `alone`: a one-rank layout run by every rank of the process group side by side (the
    ranks only meet at the step barriers)."""
    device = _device()
    probe = PeakProbe(device) if measure_memory else contextlib.nullcontext()
    times = []
    with probe:
        run = _build(config, layout, job, device, seed, alone)
        for step in range(steps):
            _barrier()
            start = time.perf_counter()
            last = measure_memory and step == steps - 1
            with probe.window() if last else contextlib.nullcontext():
                _step(run, config, layout, job, step, device)
            _barrier()
            if step:
                times.append(time.perf_counter() - start)
    return {"peak_bytes": probe.peak if measure_memory else None, "step_s": times}


def _device() -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return dev.get_device(local_rank, dev.detect_device_type())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
