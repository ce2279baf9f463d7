"""Tensor and sequence parallelism as data: a plan of DTensor styles per submodule.

A plan maps module paths (``*`` matches one path element) to PyTorch's parallel
styles: `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`,
`PrepareModuleInput`. `apply_tp` checks the plan against the module, then hands it
to `torch.distributed.tensor.parallel.parallelize_module`; the model stays a plain
module whose forward uses local shapes (``view(b, s, -1, head_dim)``), as in
torchtitan.

`llama_tp_plan` writes the usual plan for a Llama-style decoder in a few lines:
vocab-parallel embedding, column-parallel q/k/v and gate/up, row-parallel o and
down, optional sequence parallel (norms and residuals sharded along the
sequence) and loss parallel (logits stay sharded over the vocabulary and the
cross entropy runs on the shards inside `loss_parallel()`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
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


@dataclass(frozen=True)
class LlamaNames:
    """Submodule names of a Llama-style decoder (torchtitan's by default)."""

    embedding: str = "tok_embeddings"
    layers: str = "layers"
    norm: str = "norm"
    output: str = "output"
    attention: str = "attention"
    attention_norm: str = "attention_norm"
    wq: str = "wq"
    wk: str = "wk"
    wv: str = "wv"
    wo: str = "wo"
    feed_forward: str = "feed_forward"
    ffn_norm: str = "ffn_norm"
    w1: str = "w1"
    w2: str = "w2"
    w3: str = "w3"


def llama_tp_plan(
    *,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    attention_extra_args: int = 1,
    names: LlamaNames = LlamaNames(),
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a Llama-style decoder.

    Args:
        num_heads / num_kv_heads: attention heads; both must be divisible by `tp`.
        tp: tensor-parallel degree the plan is meant for.
        sequence_parallel: shard norms and residual activations along the sequence.
        loss_parallel: keep logits sharded over the vocabulary (compute the loss
            inside `loss_parallel_context(True)`).
        attention_extra_args: positional arguments the attention module takes after
            the hidden states (e.g. 1 for RoPE frequencies); they pass through as is.
        names: the submodule names of the model.

    Raises:
        ParallelError: tp does not divide the heads.
    """
    for label, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if heads % tp:
            raise ParallelError(f"tp={tp} does not divide {label}={heads}")
    n = names
    seq = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(
        input_layouts=(seq, *([None] * attention_extra_args)),
        desired_input_layouts=(Replicate(), *([None] * attention_extra_args)),
    )
    plan: dict[str, ParallelStyle] = {
        n.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        n.output: ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        n.attention: gather,
        f"{n.attention}.{n.wq}": ColwiseParallel(),
        f"{n.attention}.{n.wk}": ColwiseParallel(),
        f"{n.attention}.{n.wv}": ColwiseParallel(),
        f"{n.attention}.{n.wo}": RowwiseParallel(output_layouts=seq),
        n.feed_forward: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        f"{n.feed_forward}.{n.w1}": ColwiseParallel(),
        f"{n.feed_forward}.{n.w3}": ColwiseParallel(),
        f"{n.feed_forward}.{n.w2}": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan[n.norm] = SequenceParallel()
        block[n.attention_norm] = SequenceParallel()
        block[n.ffn_norm] = SequenceParallel()
    plan.update({f"{n.layers}.*.{k}": v for k, v in block.items()})
    return plan
