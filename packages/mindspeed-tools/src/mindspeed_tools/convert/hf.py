"""Hugging Face safetensors -> MindSpeed checkpoints, tensor by tensor (the other way is
`mindspeed_llm.hf_export.mindspeed_to_hf`).

A MindSpeed checkpoint is a DCP checkpoint: every tensor is stored once, under its
fully-qualified name with its global shape, and DCP reshards it on load. Our parallel
layouts (TP via DTensor, FSDP2, pipeline stages) keep those names, so one converted
checkpoint loads under any tp/pp/ep layout; `tp/pp/ep` check that the layout you plan
is possible for this model and record it, instead of writing per-rank shards. The family's
own Hugging Face map (`mindspeed_llm.models.hf_io`) renames and re-lays the tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mindspeed_core.checkpoint import LATEST
from mindspeed_core.errors import CheckpointError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.hf_export.dcp_stream import save_streaming
from mindspeed_llm.hf_export.staging import (
    copy_hf_files,
    progress,
    staged_output,
)
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.common.layout import check_layout
from mindspeed_llm.models.weight_check import check_weights, model_shapes

logger = logging.getLogger("mindspeed.convert")
STEP = "step_0"
OPTIMIZER_KEY = "optimizer"


@dataclass(frozen=True)
class AdamSource:
    """Adam's state to write next to the weights (`--from megatron --with-optimizer`)."""

    moments: dict[str, Path]
    """"exp_avg" / "exp_avg_sq" -> a folder of safetensors under Hugging Face names."""
    step: int
    """Adam's step count, every parameter's `step`."""
    iteration: int
    """The training step the checkpoint holds: it is written as `step_<iteration>`."""


def hf_to_mindspeed(
    source: str | Path,
    output: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: torch.dtype | None = None,
    origin: str | Path | None = None,
    adam: AdamSource | None = None,
) -> Path:
    """Convert the Hugging Face folder `source` into a MindSpeed checkpoint at `output`.

    Writes `output/step_0` (DCP, the `model` state under ModelState's names), `latest`,
    `mindspeed_manifest.json` and copies of config.json, generation_config.json and the
    tokenizer files. Tensors keep their dtype unless `dtype` is given. With `adam`, the
    folder is `step_<iteration>` and also holds the optimizer's state as a trainer saves
    it (`optimizer.state.<param>.exp_avg|exp_avg_sq|step`, moments in their stored dtype),
    which `mindspeed pretrain` resumes from (`mindspeed_llm.train.run_dir`).

    Raises:
        ConfigError / CheckpointError: bad source (named); LayoutError: a layout
            this model cannot be trained under (`models.common.layout.check_layout`).
    """
    config = hf_io.read_hf_config(source)
    check_layout(config, ParallelConfig(tp=tp, pp=pp, ep=ep), flag="--{}")
    weights = hf_io.HFWeights(source, config)
    check_weights(source, weights.shapes, model_shapes(config), weights.renamed)
    prefix = ckpt.MODEL_KEY + "."
    shapes = {prefix + n: (dtype or d, shape) for n, (d, shape) in weights.shapes.items()}
    stored = sorted({str(d).removeprefix("torch.") for d, _ in shapes.values()})
    readers = _adam_plan(adam, config, weights) if adam is not None else {}
    shapes.update({fqn: entry for fqn, (entry, _) in readers.items()})
    step = STEP if adam is None else f"step_{adam.iteration}"

    bar = progress(len(shapes), "hf -> mindspeed")

    def read(fqn: str) -> torch.Tensor:
        bar.update(1)
        if fqn in readers:
            return readers[fqn][1]()
        tensor = weights.get(fqn[len(prefix) :])
        return tensor if dtype is None else tensor.to(dtype)

    needed = sum(torch.Size(shape).numel() * d.itemsize for d, shape in shapes.values())
    with staged_output(output, needed) as tmp, bar:
        save_streaming(tmp / step, shapes, read)
        (tmp / LATEST).write_text(step + "\n")
        copied = copy_hf_files(Path(source), tmp)
        manifest = {
            "format": ckpt.MANIFEST_FORMAT,
            "version": ckpt.MANIFEST_VERSION,
            "family": config.family,
            "model_config": ckpt.config_fields(config),
            "layout": {"tp": tp, "pp": pp, "ep": ep},
            "dtype": stored[0] if len(stored) == 1 else stored,
            "source": str(Path(origin or source).resolve()),
            "files": ["config.json", *copied],
        }
        if adam is not None:
            manifest["optimizer"] = {"adam_step": adam.step, "iteration": adam.iteration}
        (tmp / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("wrote %s (%d tensors, layout tp=%d pp=%d ep=%d)", output, len(shapes), tp, pp, ep)
    return Path(output)


def _adam_plan(
    adam: AdamSource, config, weights: hf_io.HFWeights
) -> dict[str, tuple[tuple[torch.dtype, tuple[int, ...]], Callable[[], torch.Tensor]]]:
    """The optimizer's flattened state keys -> ((dtype, shape), reader): both moments and
    the step of every tensor `weights` holds, under the same names as the model's.

    Raises:
        CheckpointError: a weight without its moment, or a moment without its weight.
    """
    plan = {}
    for kind, folder in adam.moments.items():
        moments = hf_io.HFWeights(folder, config)
        odd = sorted(moments.shapes.keys() ^ weights.shapes.keys())
        if odd:
            raise CheckpointError(
                f"{adam.moments[kind]}: {odd[0]} has a weight or a {kind} but not both"
            )
        for name, entry in moments.shapes.items():
            plan[f"{OPTIMIZER_KEY}.state.{name}.{kind}"] = (entry, partial(moments.get, name))
    step = partial(torch.tensor, float(adam.step), dtype=torch.float32)  # as torch's Adam keeps it
    for name in weights.shapes:
        plan[f"{OPTIMIZER_KEY}.state.{name}.step"] = ((torch.float32, ()), step)
    return plan
