"""One training loop for every layout: the single-process reference and the parallel runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_core.optim import build_optimizers, clip_grad_norm_
from mindspeed_core.parallel import (
    ParallelDims,
    apply_ac,
    apply_ddp,
    apply_fsdp,
    apply_tp,
    loss_parallel_context,
)
from mindspeed_core.testing import import_sibling

toy = import_sibling(__file__, "toy")
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def parallelize(model, dims: ParallelDims, layout: dict, param_dtype=None):
    """TP -> AC -> FSDP/DDP, the fixed order."""
    if dims.tp > 1:
        plan = toy.tp_plan(
            sequence_parallel=layout.get("sp", False),
            loss_parallel=layout.get("loss_parallel", False),
        )
        apply_tp(model, dims.mesh("tp"), plan)
    apply_ac(model, layout.get("ac", "none"))
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reshard_after_forward=layout.get("reshard_after_forward", True),
            cpu_offload=layout.get("cpu_offload", False),
        )
    else:
        apply_ddp(model, dims.mesh("dp_replicate"), param_dtype=param_dtype)
    return model


def build(layout: dict, param_dtype=None, dtype=torch.float32):
    degrees = {k: layout[k] for k in DEGREES if k in layout}
    if "dp_shard" not in degrees:
        degrees["dp_shard"] = -1
    dims = ParallelDims(**degrees).build()
    model = parallelize(toy.make_model(dtype=dtype), dims, layout, param_dtype=param_dtype)
    return dims, model


def local_batch(dims: ParallelDims, tokens: torch.Tensor) -> torch.Tensor:
    return tokens.chunk(dims.dp)[dims.rank("dp")]


def train_step(model, dims, optimizer, tokens, labels, layout, max_norm=0.5):
    """Forward, backward, clip, step; returns (loss, grad norm) averaged over data ranks."""
    with loss_parallel_context(layout.get("loss_parallel", False)):
        logits = model(local_batch(dims, tokens))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), local_batch(dims, labels).flatten())
        loss.backward()
    norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return _mean_over(dims, toy.full(loss)), toy.full(norm)


def _mean_over(dims, value: torch.Tensor) -> torch.Tensor:
    mesh = dims.mesh("loss")
    if mesh is not None:
        dist.all_reduce(value, group=mesh.get_group())
        value = value / mesh.size()
    return value


def train(layout: dict, num_steps: int = 3, *, param_dtype=None, lr: float = 1e-3):
    """Train the toy model; the loss and grad norm per step, step-0 grads, final params."""
    dims, model = build(layout, param_dtype=param_dtype)
    # AdamW divides by sqrt(v) + eps: an element whose gradient is ~0 turns fp32
    # reduction-order noise (~1e-8) into an update of up to lr * noise / eps. eps=1e-6
    # keeps that below the test tolerance while every other element moves by ~lr.
    optimizer = build_optimizers(model, lr=lr, weight_decay=0.1, eps=1e-6)
    out = {"losses": [], "norms": []}
    for step, (tokens, labels) in enumerate(toy.make_batches(num_steps)):
        optimizer.zero_grad()
        loss, norm = train_step(model, dims, optimizer, tokens, labels, layout)
        if step == 0:  # gradients after clipping, before the next zero_grad
            out["grads"] = {n: toy.full(p.grad) for n, p in model.named_parameters()}
        out["losses"].append(loss)
        out["norms"].append(norm)
    out["params"] = {n: toy.full(p) for n, p in model.named_parameters()}
    return out
