"""One training loop for the dense decoder: one process, or pipelined through a schedule.

A step is `NUM_MICROBATCHES` microbatches (gradient accumulation in one process, one
schedule step under pp); then clip to 0.5 and AdamW. Returns losses, grad norms,
clipped step-0 gradients and final parameters by name (each rank: its own stages).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.checkpoint import CheckpointManager, ModelState
from mindspeed_core.optim import build_optimizers, clip_grad_norm_
from mindspeed_core.parallel import ParallelDims, build_pipeline_schedule, loss_parallel_context
from mindspeed_llm.data import packed_positions
from mindspeed_llm.models import build_model_config, get_model_spec

NUM_MICROBATCHES = 4
MICRO_BATCH, SEQ, VOCAB, EOD = 2, 16, 512, 7
PIPELINE_KEYS = ("schedule", "stages_per_rank", "layers_per_stage")
DEGREES = ("pp", "tp", "dp_shard", "dp_replicate")


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batches(num_steps: int, packed: bool = False):
    """Per step, NUM_MICROBATCHES (tokens, labels, kwargs); packed: documents end at EOD."""
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(
        8, VOCAB, (num_steps, NUM_MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=gen
    )
    if packed:
        data[..., 5] = EOD
        data[..., 11] = EOD
    out = []
    for step in data:
        mbs = []
        for mb in step:
            tokens, labels = mb[:, :-1], mb[:, 1:]
            kwargs = {}
            if packed:
                positions, cu_seqlens = packed_positions(tokens, EOD)
                kwargs = {"position_ids": positions, "cu_seqlens": cu_seqlens}
            mbs.append((tokens, labels, kwargs))
        out.append(mbs)
    return out


def make_model(num_layers: int = 4):
    spec = get_model_spec("llama")
    torch.manual_seed(0)
    return spec, spec.build(build_model_config("llama", flavor="debug", num_layers=num_layers))


def train(
    layout: dict | None,
    num_steps: int = 3,
    *,
    packed: bool = False,
    first_step: int = 0,
    load: str | None = None,
    save: str | None = None,
):
    """Train steps `first_step`..`num_steps - 1`; layout None is the one-process reference.

    `load` / `save`: a checkpoint folder (model and optimizer, via CheckpointManager)
    to start from / to write after the last step.
    """
    spec, whole = make_model()
    layout = dict(layout or {})
    loss_parallel = layout.pop("loss_parallel", False)
    degrees = {k: layout.pop(k) for k in DEGREES if k in layout}
    pipe_args = {k: layout.pop(k) for k in PIPELINE_KEYS if k in layout}
    dims = ParallelDims(**degrees).build()
    if dims.pp == 1:
        parts, run_step = [whole], _reference_step(whole)
    else:
        pipe = spec.pipeline(
            whole, dims, device="cpu", loss_parallel=loss_parallel, **pipe_args, **layout
        )
        schedule = build_pipeline_schedule(
            pipe.stages, NUM_MICROBATCHES, _loss_fn, pipe_args.get("schedule", "1F1B")
        )
        parts, run_step = pipe.model_parts, _pipeline_step(pipe, schedule, dims, loss_parallel)
    optimizer = build_optimizers(parts, lr=1e-3, weight_decay=0.1, eps=1e-6)
    states = {"model": ModelState(parts), "optimizer": optimizer}
    if load is not None:
        assert CheckpointManager(states, load).load() == first_step
    out = {"losses": [], "norms": []}
    for step, mbs in enumerate(batches(num_steps, packed)):
        if step < first_step:
            continue
        optimizer.zero_grad()
        out["losses"].append(run_step(mbs))
        params = list(optimizer.parameters())
        out["norms"].append(full(clip_grad_norm_(params, 0.5, pp_mesh=dims.mesh("pp"))))
        if step == first_step:  # clipped gradients
            out["grads"] = _named(parts, grads=True)
        optimizer.step()
    out["params"] = _named(parts)
    if save is not None:
        CheckpointManager(states, save).save(num_steps, force=True)
    return out


def _loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _reference_step(model):
    def run(mbs) -> torch.Tensor:
        total = torch.zeros(())
        for tokens, labels, kwargs in mbs:
            loss = _loss_fn(model(tokens, **kwargs), labels) / NUM_MICROBATCHES
            loss.backward()
            total += loss.detach()
        return total

    return run


def _pipeline_step(pipe, schedule, dims, loss_parallel: bool):
    def run(mbs) -> torch.Tensor:
        losses = []
        with loss_parallel_context(loss_parallel):
            schedule.step(
                arg_mbs=[(t,) for t, _, _ in mbs],
                kwarg_mbs=[kw for _, _, kw in mbs],
                target_mbs=[lab for _, lab, _ in mbs],
                losses=losses,
            )
        if pipe.has_last:
            loss = torch.stack([full(x) for x in losses]).mean()
        else:
            loss = torch.zeros(())
        dist.all_reduce(loss, group=dims.mesh("pp").get_group())  # only the last stage adds
        return loss

    return run


def _named(parts, grads: bool = False) -> dict[str, torch.Tensor]:
    return {
        name: full(p.grad if grads else p) for part in parts for name, p in part.named_parameters()
    }
