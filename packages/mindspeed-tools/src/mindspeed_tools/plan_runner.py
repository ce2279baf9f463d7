"""Run a few training steps of one layout on this rank, through the training engine.

Used by `mindspeed plan --calibrate` (step times) and by the tests that hold the memory
estimator and the planner against measured runs. The step is the trainer's own
(`mindspeed_llm.train`: `build_model`, `build_train_parts`, `TrainStep` with the pretraining
objective), so what the planner calibrates is what `mindspeed pretrain` runs. Random tokens,
one document per row (packed with `cu_seqlens`, as the trainer feeds them); no data pipeline
and no run directory. Call it on every rank of a process group whose size is the layout's
world size.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mindspeed_core import device as dev
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig, ParallelDims
from mindspeed_core.planning import Job, Layout
from mindspeed_core.planning.measure import PeakProbe
from mindspeed_llm.models import TransformerConfig
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep


@dataclass
class _Run:
    dims: ParallelDims
    step: TrainStep
    accum: int


def _build(config: TransformerConfig, layout: Layout, job: Job, device, seed: int,
           alone: bool = False, steps: int = 3) -> _Run:  # fmt: skip
    tp = layout.tp > 1
    # on CPU the host is the device: offload is applied below, where the engine refuses it
    offload_here = layout.activation_offload and device.type == "cpu"
    parallel = ParallelConfig(tp=layout.tp, pp=layout.pp, pp_schedule=layout.pp_schedule,
                              virtual_stages=layout.virtual_stages, cp=layout.cp, ep=layout.ep,
                              dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate,
                              sequence_parallel=layout.sequence_parallel and tp,
                              loss_parallel=layout.loss_parallel and tp,
                              activation_offload=layout.activation_offload and not offload_here)  # fmt: skip
    dims = parallel.dims(world_size=layout.world_size if alone else None)
    dims.build(device.type)
    model = build_model(config, dims, device, parallel=parallel, precision=job.precision,
                        ac=layout.ac, seed=seed, seq_len=job.seq_len)  # fmt: skip
    if offload_here:
        from mindspeed_core.memory import offload_activations

        for part in model.parts:
            offload_activations(part, allow_cpu=True)
    optim = OptimConfig(lr=1e-4, weight_decay=0.1, warmup_steps=0)
    parts = build_train_parts(model, optim, total_steps=steps, precision=job.precision)
    accum = job.grad_accum(layout)
    step = TrainStep(parts, NextToken(), dims, clip_grad=optim.clip_grad,
                     n_microbatches=accum if layout.pp > 1 else None)  # fmt: skip
    return _Run(dims, step, accum)


def _batches(config, job: Job, run: _Run, step: int, device) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches for `step`: (micro_batch, seq) rows of random tokens."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, config.vocab_size, (job.global_batch, job.seq_len + 1), generator=gen)
    mine = data.chunk(run.dims.dp)[run.dims.rank("dp")]
    out = []
    for chunk in mine.chunk(run.accum):
        rows, seq = chunk.shape[0], job.seq_len
        out.append({
            "input_ids": chunk[:, :-1].to(device), "labels": chunk[:, 1:].to(device),
            "position_ids": torch.arange(seq, device=device).repeat(rows, 1),
            "cu_seqlens": torch.arange(0, rows * seq + 1, seq, dtype=torch.int32, device=device),
        })  # fmt: skip
    return out


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
        run = _build(config, layout, job, device, seed, alone, steps)
        for step in range(steps):
            _barrier()
            start = time.perf_counter()
            last = measure_memory and step == steps - 1
            with probe.window() if last else contextlib.nullcontext():
                run.step(_batches(config, job, run, step, device))
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
