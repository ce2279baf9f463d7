"""Megatron save folders -> Hugging Face / MindSpeed, and Hugging Face -> Megatron's legacy
per-rank format: the routes `mindspeed convert --from megatron` and `--to megatron` take.
The names and layouts of both directions come from one table (`mapping`)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import ConfigError, MindSpeedError
from mindspeed_core.files import check_folder, owned_temp_prefix
from mindspeed_llm.hf_export.hf_out import plan_shards
from mindspeed_llm.hf_export.staging import (
    copy_hf_files,
    copy_tokenizer,
    counted,
    progress,
    staged_output,
    write_safetensors,
)
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.weight_check import check_weights, model_shapes
from mindspeed_tools.convert.hf import AdamSource, hf_to_mindspeed
from mindspeed_tools.convert.megatron import optim as megatron_optim
from mindspeed_tools.convert.megatron.config import check_config, hf_config, megatron_args
from mindspeed_tools.convert.megatron.legacy import write_legacy
from mindspeed_tools.convert.megatron.read import read_checkpoint

logger = logging.getLogger("mindspeed.convert")


def megatron_to_hf(
    source: str | Path,
    output: str | Path,
    *,
    tokenizer: str | Path | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> Path:
    """Convert a Megatron-LM/Megatron-Core save folder (legacy per-rank files or
    torch_dist) into a Hugging Face folder; see `mindspeed_tools.convert.megatron`.

    One tensor at a time, its shards are read, merged over tp/pp/ep and virtual-pipeline
    chunks, renamed and un-fused to Hugging Face's Llama/Qwen/Mixtral/Qwen3-MoE layout,
    written and dropped (memory holds about the largest tensor, not the model); the
    folder is checked with the same reader `--to mindspeed` uses. Megatron saves no
    tokenizer: `tokenizer` (a folder or tokenizer file) is copied in; without it the
    folder has none (logged).

    Raises:
        ConfigError / CheckpointError: a refused pickle, a missing rank file, an
            architecture we do not convert (each named).
    """
    tensors = read_checkpoint(source)
    folder = tensors.folder
    config = hf_config(tensors.args, folder)
    meta = tensors.hf_meta(config)
    if tokenizer is not None and not Path(tokenizer).exists():
        raise ConfigError(f"--tokenizer {tokenizer} does not exist")
    entries = [(hf, dtype or t.dtype, tuple(t.shape)) for hf, t in meta.items()]
    shards = plan_shards(entries, max_shard_size)
    dtypes = {str(d).removeprefix("torch.") for _, d, _ in entries}
    if len(dtypes) == 1:
        config["torch_dtype"] = dtypes.pop()
    needed = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)
    with staged_output(output, needed) as tmp:
        with progress(len(entries), "megatron -> hf") as bar:
            items = counted(tensors.hf_items(config), bar)
            write_safetensors(tmp, items, entries, shards, dtype)
        write_config(tmp, config)
        generation = {"_from_model_config": True}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        try:
            checked = hf_io.read_hf_config(tmp)
            weights = hf_io.HFWeights(tmp, checked)
            check_weights(folder, weights.shapes, model_shapes(checked), weights.renamed)
        except MindSpeedError as err:  # the input is at fault: name it, not the staging folder
            raise type(err)(str(err).replace(str(tmp), f"{folder} (converted)")) from None
        if tokenizer is not None:
            copy_tokenizer(Path(tokenizer), tmp)
        else:
            logger.warning(
                "%s: a Megatron checkpoint holds no tokenizer, so the converted model has "
                "none: pass --tokenizer DIR to copy one in",
                folder,
            )
    logger.info("wrote %s (%d tensors from Megatron %s)", output, len(entries), folder)
    return Path(output)


def megatron_to_mindspeed(
    source: str | Path,
    output: str | Path,
    *,
    tokenizer: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: torch.dtype | None = None,
    with_optimizer: bool = False,
) -> Path:
    """A Megatron save folder -> a MindSpeed checkpoint, through a Hugging Face folder
    staged next to `output` (removed afterwards), so both routes share every check.

    `with_optimizer`: Adam's moments and step come too (`megatron_optim`), renamed as the
    weights are, into `step_<Megatron's iteration>`; `mindspeed pretrain` with
    `checkpoint.load` of it goes on from that step (see `mindspeed_llm.train.run_dir`).
    """
    out = Path(output)
    check_folder(out.parent, "--output's folder")
    adam = megatron_optim.read_adam(source) if with_optimizer else None  # refusals write nothing
    temp = f"{owned_temp_prefix(out.name)}"
    staged = out.parent / f"{temp}hf"
    folders = {kind: out.parent / f"{temp}{kind}" for kind in megatron_optim.MOMENTS}
    try:
        megatron_to_hf(source, staged, tokenizer=tokenizer)
        source_adam = None
        if adam is not None:
            for kind, folder in folders.items():
                moments = adam.moments[kind]
                _stage_tensors(folder, moments.hf_meta(adam.config), moments.hf_items(adam.config))
            source_adam = AdamSource(moments=folders, step=adam.step, iteration=adam.iteration)
            del adam
        hf_to_mindspeed(
            staged, out, tp=tp, pp=pp, ep=ep, dtype=dtype, origin=source, adam=source_adam
        )
    finally:
        for folder in (staged, *folders.values()):
            shutil.rmtree(folder, ignore_errors=True)
    return out


def _stage_tensors(folder: Path, meta: dict[str, torch.Tensor], items) -> None:
    """The tensors `items` yields (as `meta` describes them) as a folder of safetensors
    (read back through `hf_io.HFWeights`)."""
    folder.mkdir()
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in meta.items()]
    write_safetensors(folder, items, entries, plan_shards(entries, 5 * 10**9), None)


def hf_to_megatron(
    source: str | Path,
    output: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype | None = None,
) -> Path:
    """A Hugging Face Llama/Mistral/Qwen2/Qwen3 folder -> Megatron's legacy per-rank checkpoint
    at tp/pp (`legacy.write_legacy`), with the folder's config and tokenizer files
    copied next to it. The whole model is read into memory once.

    Raises:
        ConfigError: a model or layout Megatron's dense GPT checkpoint cannot hold (named).
    """
    config = hf_io.read_hf_config(source)
    check_config(config, Path(source), tp, pp)
    weights = hf_io.HFWeights(source, config)
    check_weights(source, weights.shapes, model_shapes(config), weights.renamed)
    hf = {n: t if dtype is None else t.to(dtype) for n, t in hf_io.iter_hf_tensors(source)}
    stored = {t.dtype for t in hf.values() if t.is_floating_point()}
    params_dtype = stored.pop() if len(stored) == 1 else torch.float32
    args = megatron_args(config, tp, pp, params_dtype)
    needed = sum(t.numel() * t.itemsize for t in hf.values())
    with staged_output(output, needed) as tmp:
        write_legacy(tmp, hf, config, tp, pp, args)
        copy_hf_files(Path(source), tmp)
    logger.info("wrote %s (Megatron legacy checkpoint, tp=%d pp=%d)", output, tp, pp)
    return Path(output)


def write_config(folder: Path, config: Mapping[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
