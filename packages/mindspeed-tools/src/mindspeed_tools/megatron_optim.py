"""Megatron's Adam state (exp_avg, exp_avg_sq, step), read without running code, as Hugging
Face tensors: what `mindspeed convert --from megatron --with-optimizer` carries over.

Converted: a torch_dist save (Megatron-LM's default `--ckpt-format`) of fp32 training with
the non-distributed optimizer. Megatron-Core's `FP32Optimizer.sharded_state_dict(model_sd)`
stores each moment as a global tensor in its weight's layout, keyed after that weight::

    optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight      (num_layers, 2*ffn, hidden)
    optimizer.state.exp_avg_sq.embedding.word_embeddings.weight       (vocab, hidden)

and its step in `common.pt`: `optimizer.state.common_step` (torch's Adam keeps one per
parameter; Megatron saves the shared one) or `param_groups[i].step` (Apex's and Transformer
Engine's FusedAdam). The moments then take the weights' road (`megatron.unstack_layers`,
`megatron.to_hf_tensors`: fused q/k/v split per query group, fc1 into gate and up), which
is exact because those are re-indexings and Adam's state is elementwise.

Refused, one line naming the file (nothing written): a save without optimizer state; the
legacy per-rank format (`model_optim_rng.pt` keeps torch's optimizer state by parameter
index, whose order follows Megatron's parameter groups); the distributed optimizer
(`param_state_sharding_type`: its default dp_reshardable layout stores flat buffers per
data-parallel rank); mixed precision (`fp32_param`: the fp32 master weights are not carried).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.checkpoint import read_safe_metadata
from mindspeed_core.errors import CheckpointError
from mindspeed_tools import megatron
from mindspeed_tools.dcp_stream import load_streaming

MOMENTS = ("exp_avg", "exp_avg_sq")
_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([a-z0-9_]+)\.(.+)$")


@dataclass(frozen=True)
class MegatronAdam:
    """Megatron's Adam state under Hugging Face names."""

    step: int
    """Adam's step count (its bias correction), shared by every parameter."""
    iteration: int
    """The training iteration the checkpoint was saved at."""
    moments: dict[str, dict[str, torch.Tensor]]
    """"exp_avg" / "exp_avg_sq" -> Hugging Face name -> whole tensor."""


def read_adam(root: str | Path) -> MegatronAdam:
    """The Adam state of the Megatron save folder `root`, renamed as `convert.megatron_to_hf`
    renames its weights.

    Raises:
        CheckpointError / ConfigError: no optimizer state, or one we do not convert (named).
    """
    folder = megatron.iteration_dir(Path(root))
    common = folder / megatron.COMMON_FILE
    if not common.is_file():
        file = next(iter(sorted(folder.glob(f"mp_rank_*/{megatron.LEGACY_FILE}"))), folder)
        raise CheckpointError(
            f"{file}: --with-optimizer converts torch_dist saves only (--ckpt-format torch_dist, "
            "Megatron-LM's default); a legacy file keeps Adam's state by parameter index"
        )
    saved = megatron.safe_torch_load(common)
    args = megatron._args_of(saved, common)
    config = megatron.hf_config(args, folder)
    optimizer = saved.get("optimizer")
    step = _adam_step(optimizer, common)
    stacked = _read_moments(folder, common)
    num_layers = megatron._arg(args, "num_layers", common)
    moments = {}
    for kind in MOMENTS:
        layers = megatron.unstack_layers(stacked[kind], num_layers, folder)
        moments[kind] = megatron.to_hf_tensors(layers, config, folder)
    iteration = saved.get("iteration", step)
    return MegatronAdam(step=step, iteration=int(iteration), moments=moments)


def _adam_step(optimizer: Any, file: Path) -> int:
    """The step Megatron saved in `common.pt`'s "optimizer" (one optimizer's dict, or a
    ChainedOptimizer's {index: dict}); every optimizer and group must agree."""
    if not isinstance(optimizer, Mapping) or not optimizer:
        raise CheckpointError(
            f"{file} holds no optimizer state (was the run saved with --no-save-optim?)"
        )
    parts = [optimizer] if "param_groups" in optimizer else list(optimizer.values())
    steps = set()
    for part in parts:
        if not isinstance(part, Mapping):
            raise CheckpointError(f"{file}: its optimizer entry is not Megatron's state dict")
        if "param_state_sharding_type" in part:
            raise CheckpointError(
                f"{file}: the distributed optimizer's state "
                f"(param_state_sharding_type={part['param_state_sharding_type']!r}) is not "
                "converted; save with --no-use-distributed-optimizer"
            )
        common = (part.get("state") or {}).get("common_step")
        if common is not None:
            steps.add(int(common))
        steps.update(int(g["step"]) for g in part.get("param_groups", ()) if "step" in g)
    if len(steps) != 1:
        found = "none" if not steps else sorted(steps)
        raise CheckpointError(f"{file}: expected one Adam step count, found {found}")
    return steps.pop()


def _read_moments(folder: Path, common: Path) -> dict[str, dict[str, torch.Tensor]]:
    """"exp_avg" / "exp_avg_sq" -> Megatron's name -> the tensor as torch_dist stored it."""
    metadata = read_safe_metadata(folder)
    shapes, names = {}, {}
    for key, meta in metadata.state_dict_metadata.items():
        match = _KEY.match(key)
        if not match or getattr(meta, "size", None) is None:
            continue
        kind, name = match.groups()
        if kind == "fp32_param":
            raise CheckpointError(
                f"{folder}: {key}: mixed-precision (bf16/fp16) optimizer state is not converted "
                "(its fp32 master weights would be lost); fp32 training only"
            )
        if kind not in MOMENTS:
            raise CheckpointError(f"{folder}: {key}: optimizer state {kind!r} is not Adam's")
        shapes[key] = (meta.properties.dtype, tuple(meta.size))
        names[key] = (kind, name)
    if not shapes:
        raise CheckpointError(
            f"{folder}: its .metadata holds no optimizer.state.exp_avg.* (saved without the "
            f"optimizer, e.g. --no-save-optim; {common.name} names none either)"
        )
    moments: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in MOMENTS}

    def done(key: str, tensor: torch.Tensor) -> None:
        kind, name = names[key]
        moments[kind][name] = tensor

    load_streaming(folder, shapes, done)
    if moments["exp_avg"].keys() != moments["exp_avg_sq"].keys():
        odd = sorted(moments["exp_avg"].keys() ^ moments["exp_avg_sq"].keys())
        raise CheckpointError(f"{folder}: exp_avg and exp_avg_sq differ in {odd[0]}")
    return moments
