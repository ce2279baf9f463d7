"""Tensor and sequence parallelism as data: a plan of DTensor styles per submodule.

A plan maps module paths (``*`` matches one path element) to PyTorch's parallel
styles: `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`,
`PrepareModuleInput`. `apply_tp` checks the plan against the module, then hands it
to `torch.distributed.tensor.parallel.parallelize_module`; the model stays a plain
module whose forward uses local shapes (``view(b, s, -1, head_dim)``), as in
torchtitan.

The plan of a given architecture belongs beside the model, not here (e.g.
`mindspeed_llm.models.common.tp_plan` for MindSpeed's decoder, as torchtitan keeps
each model's plan in that model's folder); core only applies and checks plans.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from mindspeed_core.errors import ParallelError

TPPlan = Mapping[str, ParallelStyle]


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh | None, plan: TPPlan) -> nn.Module:
    """Shard `module` in place over `tp_mesh` following `plan`; None mesh is a no-op.

    Raises:
        ParallelError: a plan entry names no submodule, or a sharded dimension is
            not divisible by the tensor-parallel degree.
    """
    if tp_mesh is None:
        return module
    if tp_mesh.ndim != 1:
        raise ParallelError(f"apply_tp needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D")
    _check_plan(module, plan, tp_mesh.size())
    parallelize_module(module, tp_mesh, dict(plan))
    return module


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap the loss and its backward when the plan keeps logits vocab-sharded."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def _check_plan(module: nn.Module, plan: TPPlan, tp: int) -> None:
    names = dict(module.named_modules())
    for pattern, style in plan.items():
        matches = [
            n for n in names if n and fnmatch.fnmatchcase(n, pattern) and _same_depth(n, pattern)
        ]
        if not matches:
            raise ParallelError(
                f"tensor-parallel plan entry {pattern!r} matches no submodule of "
                f"{type(module).__name__}"
            )
        for name in matches:
            _check_divisible(name, names[name], style, tp)


def _same_depth(name: str, pattern: str) -> bool:
    return name.count(".") == pattern.count(".")


def _check_divisible(name: str, sub: nn.Module, style: ParallelStyle, tp: int) -> None:
    weight = getattr(sub, "weight", None)
    if weight is None or isinstance(style, SequenceParallel | PrepareModuleInput):
        return
    # nn.Linear shards rows for colwise and columns for rowwise; nn.Embedding the reverse.
    colwise = isinstance(style, ColwiseParallel)
    dim = (0 if colwise else 1) if isinstance(sub, nn.Linear) else (1 if colwise else 0)
    if weight.dim() > dim and weight.shape[dim] % tp:
        raise ParallelError(
            f"{name}.weight has size {weight.shape[dim]} along the dimension tensor parallel "
            f"splits, which tp={tp} does not divide"
        )
