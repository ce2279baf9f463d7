"""Megatron's Adam state (exp_avg, exp_avg_sq, step), read without running code, as Hugging
Face tensors: what `mindspeed convert --from megatron --with-optimizer` carries over.

Converted: a torch_dist save (Megatron-LM's default `--ckpt-format`) of fp32 training with
the non-distributed optimizer. Megatron-Core's `FP32Optimizer.sharded_state_dict(model_sd)`
stores each moment as a global tensor in its weight's layout, keyed after that weight::

    optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight      (num_layers, 2*ffn, hidden)
    optimizer.state.exp_avg_sq.embedding.word_embeddings.weight       (vocab, hidden)

and its step in `common.pt`: `optimizer.state.common_step` (torch's Adam keeps one per
parameter; Megatron saves the shared one) or `param_groups[i].step` (Apex's and Transformer
Engine's FusedAdam). The moments then take the weights' road (`stored_tensors`,
one layer's slice at a time, and `mapping.to_hf_tensors`: fused q/k/v split per query
group, fc1 into gate and up), which is exact because those are re-indexings and Adam's
state is elementwise.

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

from mindspeed_core.checkpoint import read_safe_metadata
from mindspeed_core.errors import CheckpointError
from mindspeed_tools.convert.megatron.config import hf_config
from mindspeed_tools.convert.megatron.files import (
    COMMON_FILE,
    LEGACY_FILE,
    MegatronTensors,
    args_of,
    iteration_dir,
    safe_torch_load,
)
from mindspeed_tools.convert.megatron.torch_dist import stored_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")
_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([a-z0-9_]+)\.(.+)$")


@dataclass(frozen=True)
class MegatronAdam:
    """Megatron's Adam state under Hugging Face names."""

    step: int
    """Adam's step count (its bias correction), shared by every parameter."""
    iteration: int
    """The training iteration the checkpoint was saved at."""
    moments: dict[str, MegatronTensors]
    """"exp_avg" / "exp_avg_sq" -> the moments under Megatron's weight names, read one
    at a time (`hf_items(config)` renames them as `convert.megatron_to_hf` renames the
    weights)."""
    config: dict[str, Any]
    """The Hugging Face config of the model (`hf_config`)."""


def read_adam(root: str | Path) -> MegatronAdam:
    """The Adam state of the Megatron save folder `root` (its structure is read and checked
    now, the moments when asked for).

    Raises:
        CheckpointError / ConfigError: no optimizer state, or one we do not convert (named).
    """
    folder = iteration_dir(Path(root))
    common = folder / COMMON_FILE
    if not common.is_file():
        file = next(iter(sorted(folder.glob(f"mp_rank_*/{LEGACY_FILE}"))), folder)
        raise CheckpointError(
            f"{file}: --with-optimizer converts torch_dist saves only (--ckpt-format torch_dist, "
            "Megatron-LM's default); a legacy file keeps Adam's state by parameter index"
        )
    saved = safe_torch_load(common)
    args = args_of(saved, common)
    config = hf_config(args, folder)
    optimizer = saved.get("optimizer")
    step = _adam_step(optimizer, common)
    moments = _read_moments(folder, common, args)
    for kind in MOMENTS:
        moments[kind].hf_meta(config)  # every moment has a Hugging Face name
    iteration = saved.get("iteration", step)
    return MegatronAdam(step=step, iteration=int(iteration), moments=moments, config=config)


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


def _read_moments(folder: Path, common: Path, args: dict[str, Any]) -> dict[str, MegatronTensors]:
    """ "exp_avg" / "exp_avg_sq" -> its tensors under Megatron's weight names."""
    metadata = read_safe_metadata(folder)
    names: dict[str, dict[str, str]] = {kind: {} for kind in MOMENTS}
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
        names[kind][key] = name
    if not any(names.values()):
        raise CheckpointError(
            f"{folder}: its .metadata holds no optimizer.state.exp_avg.* (saved without the "
            f"optimizer, e.g. --no-save-optim; {common.name} names none either)"
        )
    first, second = (set(names[kind].values()) for kind in MOMENTS)
    if first != second:
        odd = sorted(first ^ second)[0]
        raise CheckpointError(f"{folder}: exp_avg and exp_avg_sq differ in {odd}")
    return {kind: stored_tensors(folder, args, metadata, names[kind]) for kind in MOMENTS}
