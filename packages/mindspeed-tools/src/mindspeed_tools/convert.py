"""`mindspeed convert`: Hugging Face safetensors <-> MindSpeed checkpoints, tensor by tensor.

    mindspeed convert --input HF_DIR --output OUT --to mindspeed [--tp 2 --pp 2 --ep 1]
    mindspeed convert --input CKPT --output HF_OUT --to hf [--max-shard-size 5GB]
    mindspeed convert --input LORA_RUN_CKPT --output HF_OUT --to hf --merge-lora
    mindspeed convert --input LORA_RUN_CKPT --output PEFT_OUT --to peft
    mindspeed convert --input MEGATRON_SAVE --output OUT --to hf [--tokenizer DIR]
    mindspeed convert --input MEGATRON_SAVE --output OUT --to mindspeed --with-optimizer
    mindspeed convert --input HF_DIR --output MEGATRON_SAVE --to megatron --tp 2 --pp 2

A MindSpeed checkpoint is a DCP checkpoint: every tensor is stored once, under its
fully-qualified name with its global shape, and DCP reshards it on load. Our parallel
layouts (TP via DTensor, FSDP2, pipeline stages) keep those names, so one converted
checkpoint loads under any tp/pp/ep layout; `--tp/--pp/--ep` check that the layout you plan
is possible for this model and record it, instead of writing per-rank shards.

The output is written to `OUT.tmp-HOST.PID.*` and renamed to `OUT` when complete: a
failed conversion (a full disk included) leaves nothing behind, and the temporaries of a
convert that was killed are removed by the next one into the same place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from mindspeed_core.checkpoint import LATEST
from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.distributed import setup_logging
from mindspeed_core.errors import (
    CheckpointError,
    ConfigError,
    MindSpeedError,
    disk_full_error,
    is_disk_full,
)
from mindspeed_core.files import check_folder, fsync_dir, owned_temp_prefix, remove_stale_temps
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.loading import ModelSource, checkpoint_source
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.common.layout import check_layout
from mindspeed_llm.models.weight_check import check_weights, model_shapes
from mindspeed_llm.peft.checkpoint import run_lora, write_peft_adapter
from mindspeed_tools import megatron, megatron_optim, megatron_save
from mindspeed_tools.dcp_stream import load_streaming, save_streaming
from mindspeed_tools.hf_out import OursToHF, ShardedWriter, plan_shards
from mindspeed_tools.lora_merge import LoRAMerge

logger = logging.getLogger("mindspeed.convert")
DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
HF_EXTRA_FILES = ("generation_config.json", *TOKENIZER_FILES)
STEP = "step_0"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


OPTIMIZER_KEY = "optimizer"


# -- Hugging Face -> MindSpeed ------------------------------------------------------------


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

    bar = _progress(len(shapes), "hf -> mindspeed")

    def read(fqn: str) -> torch.Tensor:
        bar.update(1)
        if fqn in readers:
            return readers[fqn][1]()
        tensor = weights.get(fqn[len(prefix) :])
        return tensor if dtype is None else tensor.to(dtype)

    needed = sum(torch.Size(shape).numel() * d.itemsize for d, shape in shapes.values())
    with _staging(output, needed) as tmp, bar:
        save_streaming(tmp / step, shapes, read)
        (tmp / LATEST).write_text(step + "\n")
        copied = _copy_hf_files(Path(source), tmp)
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


# -- MindSpeed -> Hugging Face ------------------------------------------------------------


def mindspeed_to_hf(
    source: str | Path,
    output: str | Path,
    *,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> Path:
    """Convert a MindSpeed checkpoint (converted, or a trainer's) into a Hugging Face folder.

    `source` is a converted folder, `<run>/checkpoints` (its `latest`), or one `step_<N>`.
    Writes config.json, generation_config.json, tokenizer files when known, and
    model.safetensors or shards with model.safetensors.index.json.

    Raises:
        ConfigError / CheckpointError: the source is not a checkpoint or is incomplete.
    """
    model = checkpoint_source(source)
    if model.kind == "run" and run_lora(model.path) is not None:
        raise ConfigError(
            f"{source} is a LoRA run's checkpoint (adapters only): add --merge-lora, or use --to peft"
        )
    config, step_dir = model.config, model.weights
    stored = ckpt.tensor_metadata(step_dir)
    to_hf = OursToHF(config, stored)
    entries = [(hf, dtype or d, shape) for hf, (d, shape) in to_hf.shapes.items()]
    shards = plan_shards(entries, max_shard_size)
    prefix = ckpt.MODEL_KEY + "."
    wanted = {prefix + ours: stored[ours] for ours in stored if ours in to_hf.wanted}

    needed = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)
    with _staging(output, needed) as tmp:
        writer = ShardedWriter(tmp, entries, shards, dtype)
        bar = _progress(len(wanted), "mindspeed -> hf")

        def done(fqn: str, tensor: torch.Tensor) -> None:
            bar.update(1)
            for hf, made in to_hf.put(fqn[len(prefix) :], tensor):
                writer.write(hf, made)

        with writer, bar:
            load_streaming(step_dir, wanted, done)
        _write_hf_config(model, tmp, entries)
    logger.info("wrote %s (%d tensors in %d file(s))", output, len(entries), len(shards))
    return Path(output)


# -- LoRA runs: merged Hugging Face weights, or a peft adapter ------------------------------


def _lora_source(source: str | Path, flag: str):
    model = checkpoint_source(source)
    lora = run_lora(model.path) if model.kind == "run" else None
    if lora is None:
        raise ConfigError(
            f"{flag}: {source} is not a LoRA run's checkpoint (its config.yaml has no lora.rank > 0)"
        )
    return model, lora


def merge_lora_to_hf(
    source: str | Path,
    output: str | Path,
    *,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> Path:
    """A Hugging Face folder holding a LoRA run's base with its adapters merged
    (W + scaling B A), one base tensor at a time (`lora_merge.LoRAMerge`): memory holds
    about one tensor and the adapters, never the model."""
    model_source, lora = _lora_source(source, "--merge-lora")
    merge = LoRAMerge(model_source, lora)
    to_hf = OursToHF(model_source.config, merge.shapes)
    entries = [(hf, dtype or d, shape) for hf, (d, shape) in to_hf.shapes.items()]
    shards = plan_shards(entries, max_shard_size)
    needed = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)
    with _staging(output, needed) as tmp:
        writer = ShardedWriter(tmp, entries, shards, dtype)
        bar = _progress(len(merge.shapes), "merge lora -> hf")

        def put(name: str, tensor: torch.Tensor) -> None:
            bar.update(1)
            for hf, made in to_hf.put(name, tensor):
                writer.write(hf, made)

        with writer, bar:
            merge.stream(put)
        _write_hf_config(model_source, tmp, entries)
    logger.info("wrote %s (LoRA merged, %d tensors)", output, len(entries))
    return Path(output)


def _write_safetensors(tmp: Path, items, entries, shards, dtype) -> None:
    """Write `items` ((name, tensor) pairs, in any order, each dropped once written) into
    the planned `shards` (and the index when several)."""
    with ShardedWriter(tmp, entries, shards, dtype) as writer:
        for name, tensor in items:
            writer.write(name, tensor)


# -- Megatron -> Hugging Face / MindSpeed ---------------------------------------------------


def megatron_to_hf(
    source: str | Path,
    output: str | Path,
    *,
    tokenizer: str | Path | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> Path:
    """Convert a Megatron-LM/Megatron-Core save folder (legacy per-rank files or
    torch_dist) into a Hugging Face folder; see `mindspeed_tools.megatron`.

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
    tensors = megatron.read_checkpoint(source)
    folder = tensors.folder
    config = megatron.hf_config(tensors.args, folder)
    meta = tensors.hf_meta(config)
    if tokenizer is not None and not Path(tokenizer).exists():
        raise ConfigError(f"--tokenizer {tokenizer} does not exist")
    entries = [(hf, dtype or t.dtype, tuple(t.shape)) for hf, t in meta.items()]
    shards = plan_shards(entries, max_shard_size)
    dtypes = {str(d).removeprefix("torch.") for _, d, _ in entries}
    if len(dtypes) == 1:
        config["torch_dtype"] = dtypes.pop()
    needed = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)
    with _staging(output, needed) as tmp:
        with _progress(len(entries), "megatron -> hf") as bar:
            items = _counted(tensors.hf_items(config), bar)
            _write_safetensors(tmp, items, entries, shards, dtype)
        megatron.write_config(tmp, config)
        generation = {"_from_model_config": True}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        try:
            checked = hf_io.read_hf_config(tmp)
            weights = hf_io.HFWeights(tmp, checked)
            check_weights(folder, weights.shapes, model_shapes(checked), weights.renamed)
        except MindSpeedError as err:  # the input is at fault: name it, not the staging folder
            raise type(err)(str(err).replace(str(tmp), f"{folder} (converted)")) from None
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp)
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
    _write_safetensors(folder, items, entries, plan_shards(entries, 5 * 10**9), None)


def hf_to_megatron(
    source: str | Path,
    output: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype | None = None,
) -> Path:
    """A Hugging Face Llama/Mistral/Qwen2/Qwen3 folder -> Megatron's legacy per-rank checkpoint
    at tp/pp (`mindspeed_tools.megatron_save`), with the folder's config and tokenizer files
    copied next to it. The whole model is read into memory once.

    Raises:
        ConfigError: a model or layout Megatron's dense GPT checkpoint cannot hold (named).
    """
    config = hf_io.read_hf_config(source)
    megatron_save.check_config(config, Path(source), tp, pp)
    weights = hf_io.HFWeights(source, config)
    check_weights(source, weights.shapes, model_shapes(config), weights.renamed)
    hf = {n: t if dtype is None else t.to(dtype) for n, t in hf_io.iter_hf_tensors(source)}
    stored = {t.dtype for t in hf.values() if t.is_floating_point()}
    params_dtype = stored.pop() if len(stored) == 1 else torch.float32
    args = megatron_save.megatron_args(config, tp, pp, params_dtype)
    needed = sum(t.numel() * t.itemsize for t in hf.values())
    with _staging(output, needed) as tmp:
        megatron_save.write_legacy(tmp, hf, config, tp, pp, args)
        _copy_hf_files(Path(source), tmp)
    logger.info("wrote %s (Megatron legacy checkpoint, tp=%d pp=%d)", output, tp, pp)
    return Path(output)


def lora_to_peft(source: str | Path, output: str | Path) -> Path:
    """adapter_config.json + adapter_model.safetensors of a LoRA run, for
    `peft.PeftModel.from_pretrained(base, output)`."""
    model, lora = _lora_source(source, "--to peft")
    needed = sum(
        d.itemsize * torch.Size(s).numel() for d, s in ckpt.tensor_metadata(model.weights).values()
    )
    with _staging(output, needed) as tmp:  # at most the step's model tensors
        write_peft_adapter(model.path, model.weights, model.config, lora, tmp)
    logger.info("wrote %s (peft adapter, rank %d)", output, lora.rank)
    return Path(output)


def _write_hf_config(model: ModelSource, tmp: Path, entries) -> None:
    """config.json (the source's when it has one, else built from our config), plus the
    generation config and tokenizer files of the source when known."""
    dtypes = {str(d).removeprefix("torch.") for _, d, _ in entries if d.is_floating_point}
    if model.hf_dir is not None:
        hf_config = json.loads((model.hf_dir / hf_io.CONFIG_FILE).read_text())
        _copy_hf_files(model.hf_dir, tmp)
    else:
        hf_config = model.config.to_hf_dict()
    if len(dtypes) == 1:
        key = "dtype" if "dtype" in hf_config else "torch_dtype"
        hf_config[key] = dtypes.pop()
    (tmp / hf_io.CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    if not any((tmp / n).is_file() for n in TOKENIZER_FILES):
        _copy_tokenizer(model.tokenizer, tmp)
    if not (tmp / "generation_config.json").is_file():
        generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config}
        (tmp / "generation_config.json").write_text(
            json.dumps({"_from_model_config": True, **generation}, indent=2) + "\n"
        )


def _copy_tokenizer(tokenizer: Path, dest: Path) -> None:
    """The run's tokenizer: a folder's tokenizer files, a tokenizer.json, or a sentencepiece
    .model (saved as tokenizer.model)."""
    if tokenizer.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, dest / name)
    elif tokenizer.suffix == ".json":
        shutil.copy2(tokenizer, dest / "tokenizer.json")
    elif tokenizer.suffix == ".model":
        shutil.copy2(tokenizer, dest / "tokenizer.model")


# -- shared -------------------------------------------------------------------------------


def _progress(total: int, desc: str) -> tqdm:
    """A tensor-count progress bar on an interactive terminal (silent in logs and tests)."""
    return tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty())


def _counted(items, bar: tqdm):
    """`items`, advancing `bar` by one for each."""
    for item in items:
        yield item
        bar.update(1)


def _copy_hf_files(source: Path, dest: Path) -> list[str]:
    """Copy config.json, the generation config and tokenizer files that exist in `source`."""
    copied = []
    for name in (hf_io.CONFIG_FILE, *HF_EXTRA_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
            if name != hf_io.CONFIG_FILE:
                copied.append(name)
    return copied


@contextlib.contextmanager
def _staging(output: str | Path, needed_bytes: int) -> Iterator[Path]:
    """A fresh `OUT.tmp-HOST.PID.*` folder, renamed to `output` on success and removed on
    failure (a full disk becomes one line). Temporaries a killed convert left next to
    `output` are removed first. An `output` that is an existing empty folder (a container's
    volume: a mount point, which cannot be renamed over, under a parent that may be
    read-only) gets the folder inside it, and its entries are moved up at the end."""
    out = Path(output)
    inside = out.is_dir()
    if inside:
        remove_stale_temps(out, out.name)
    if out.exists() and (not inside or any(out.iterdir())):
        raise ConfigError(f"output {out} already exists; remove it or choose another path")
    check_folder(out.parent, "--output's folder")
    home = out if inside else out.parent
    made = [] if inside else [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        home.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temps(home, out.name):
            logger.debug("removed %s, left by a convert that was killed", stale)
        tmp = Path(tempfile.mkdtemp(prefix=owned_temp_prefix(out.name), dir=home))
    except OSError as err:
        _remove_made(made)
        raise ConfigError(f"--output {out}: cannot write in {home}: {err.strerror or err}") from None
    moved: list[Path] = []
    try:
        yield tmp
        if inside:
            _move_entries(tmp, out, moved)
        else:
            os.rename(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        for entry in moved:  # moved up before the failure
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        _remove_made(made)
        if is_disk_full(err):
            raise disk_full_error(out, needed_bytes) from None
        raise


_WRITTEN_LAST = (hf_io.CONFIG_FILE, "model.safetensors.index.json", LATEST, ".metadata")
"""What readers look for first: moved into an output folder after the rest."""


def _move_entries(staging: Path, out: Path, moved: list[Path]) -> None:
    """Move `staging`'s entries into `out` (same file system: renames; each one `moved`),
    those that make a folder look complete last, and remove `staging`."""
    entries = sorted(staging.iterdir(), key=lambda p: (p.name in _WRITTEN_LAST, p.name))
    for entry in entries:
        os.rename(entry, out / entry.name)
        moved.append(out / entry.name)
    staging.rmdir()
    fsync_dir(out)


def _remove_made(made: list[Path]) -> None:
    for parent in made:  # innermost first: the folders this call created
        with contextlib.suppress(OSError):
            parent.rmdir()


def parse_size(text: str) -> int:
    """Bytes in "5GB", "500MB", "2GiB" or a plain number of bytes.

    Raises:
        ConfigError: not a size.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"--max-shard-size={text!r} is not a size like 5GB or 500MB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]
    if value < 1:
        raise ConfigError(f"--max-shard-size={text!r} must be positive")
    return int(value)


# -- command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mindspeed convert",
        description="Convert Hugging Face safetensors <-> MindSpeed (DCP) checkpoints, "
        "tensor by tensor. One MindSpeed checkpoint loads under any tp/pp/ep layout.",
    )
    p.add_argument(
        "--input", required=True, help="HF folder, MindSpeed checkpoint, or Megatron save folder"
    )
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("hf", "mindspeed", "megatron"),
        help="source format (default: a Megatron save folder is recognised by its "
        f"{megatron.LATEST_FILE}; otherwise hf for --to mindspeed, mindspeed for --to hf)",
    )
    p.add_argument(
        "--tokenizer", help="--from megatron: tokenizer folder or file to copy into the output"
    )
    p.add_argument("--output", required=True, help="folder to create (must not exist)")
    p.add_argument(
        "--to", required=True, choices=("mindspeed", "hf", "peft", "megatron"), help="target format"
    )
    p.add_argument("--merge-lora", action="store_true", help="--to hf: merge a LoRA run's adapters")
    p.add_argument(
        "--tp", type=int, default=1, help="tp degree to check (--to megatron: to write)"
    )
    p.add_argument(
        "--pp", type=int, default=1, help="pp degree to check (--to megatron: to write)"
    )
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree to validate")
    p.add_argument(
        "--with-optimizer",
        action="store_true",
        help="--from megatron --to mindspeed: carry Adam's moments and step (torch_dist saves)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help="stored dtype")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: largest safetensors file")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    dtype = DTYPES[args.dtype]
    if args.merge_lora and args.to != "hf":
        raise ConfigError("--merge-lora applies to --to hf only")
    source_format = args.source_format
    if source_format is None and megatron.is_megatron_checkpoint(args.input):
        source_format = "megatron"
    if args.tokenizer is not None and source_format != "megatron":
        raise ConfigError("--tokenizer applies to --from megatron only")
    if args.with_optimizer and (source_format != "megatron" or args.to != "mindspeed"):
        raise ConfigError("--with-optimizer applies to --from megatron --to mindspeed only")
    if source_format == "megatron":
        if args.to == "peft" or args.merge_lora:
            raise ConfigError("--from megatron converts to --to hf or --to mindspeed")
        if not megatron.is_megatron_checkpoint(args.input):
            raise ConfigError(f"--from megatron: {args.input} has no {megatron.LATEST_FILE}")
        if args.to == "mindspeed":
            megatron_to_mindspeed(
                args.input,
                args.output,
                tokenizer=args.tokenizer,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                dtype=dtype,
                with_optimizer=args.with_optimizer,
            )
        else:
            if (args.tp, args.pp, args.ep) != (1, 1, 1):
                raise ConfigError("--tp/--pp/--ep apply to --to mindspeed only")
            size = parse_size(args.max_shard_size)
            megatron_to_hf(
                args.input, args.output, tokenizer=args.tokenizer, max_shard_size=size, dtype=dtype
            )
        return 0
    expected = {"mindspeed": "hf", "hf": "mindspeed", "peft": "mindspeed", "megatron": "hf"}
    expected = expected[args.to]
    if source_format not in (None, expected):
        raise ConfigError(f"--from {source_format} --to {args.to} is not a conversion we make")
    if args.to == "megatron":
        if args.merge_lora or args.ep != 1:
            raise ConfigError("--to megatron takes --tp and --pp only (dense models)")
        hf_to_megatron(args.input, args.output, tp=args.tp, pp=args.pp, dtype=dtype)
    elif args.to == "peft":
        lora_to_peft(args.input, args.output)
    elif args.to == "mindspeed":
        hf_to_mindspeed(args.input, args.output, tp=args.tp, pp=args.pp, ep=args.ep, dtype=dtype)
    else:
        if (args.tp, args.pp, args.ep) != (1, 1, 1):
            raise ConfigError("--tp/--pp/--ep apply to --to mindspeed only")
        size = parse_size(args.max_shard_size)
        to_hf = merge_lora_to_hf if args.merge_lora else mindspeed_to_hf
        to_hf(args.input, args.output, max_shard_size=size, dtype=dtype)
    return 0


command = Command(help="convert Hugging Face <-> MindSpeed checkpoints (any layout)", run=main)
