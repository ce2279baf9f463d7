"""Our checkpoints as Hugging Face folders, one tensor at a time: what `mindspeed convert --to
hf` runs and what the trainer's `logging.hf_export_every` calls in process (rank 0 only).

`mindspeed_to_hf` streams a checkpoint's tensors (`dcp_stream.load_streaming`) through the
family's Hugging Face map (`hf_out.OursToHF`) into safetensors files written as tensors
arrive (`hf_out.ShardedWriter`); `merge_lora_to_hf` does the same for a LoRA run with each
base tensor's adapter folded in (`lora_merge.LoRAMerge`). Memory holds about one tensor,
never the model; the folder appears only when complete (`staging.staged_output`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from mindspeed_core.errors import ConfigError
from mindspeed_llm.hf_export.dcp_stream import load_streaming
from mindspeed_llm.hf_export.hf_out import OursToHF, ShardedWriter, plan_shards
from mindspeed_llm.hf_export.lora_merge import LoRAMerge
from mindspeed_llm.hf_export.staging import (
    TOKENIZER_FILES,
    copy_hf_files,
    copy_tokenizer,
    progress,
    staged_output,
)
from mindspeed_llm.loading import ModelSource, checkpoint_source
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models import hf_io
from mindspeed_llm.peft.checkpoint import run_lora

logger = logging.getLogger("mindspeed.convert")


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
    with staged_output(output, needed) as tmp:
        writer = ShardedWriter(tmp, entries, shards, dtype)
        bar = progress(len(wanted), "mindspeed -> hf")

        def done(fqn: str, tensor: torch.Tensor) -> None:
            bar.update(1)
            for hf, made in to_hf.put(fqn[len(prefix) :], tensor):
                writer.write(hf, made)

        with writer, bar:
            load_streaming(step_dir, wanted, done)
        write_hf_config(model, tmp, entries)
    logger.info("wrote %s (%d tensors in %d file(s))", output, len(entries), len(shards))
    return Path(output)


def write_hf_config(model: ModelSource, tmp: Path, entries) -> None:
    """config.json (the source's when it has one, else built from our config), plus the
    generation config and tokenizer files of the source when known."""
    dtypes = {str(d).removeprefix("torch.") for _, d, _ in entries if d.is_floating_point}
    if model.hf_dir is not None:
        hf_config = json.loads((model.hf_dir / hf_io.CONFIG_FILE).read_text())
        copy_hf_files(model.hf_dir, tmp)
    else:
        hf_config = model.config.to_hf_dict()
    if len(dtypes) == 1:
        key = "dtype" if "dtype" in hf_config else "torch_dtype"
        hf_config[key] = dtypes.pop()
    (tmp / hf_io.CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    if not any((tmp / n).is_file() for n in TOKENIZER_FILES):
        copy_tokenizer(model.tokenizer, tmp)
    if not (tmp / "generation_config.json").is_file():
        generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config}
        (tmp / "generation_config.json").write_text(
            json.dumps({"_from_model_config": True, **generation}, indent=2) + "\n"
        )


# -- LoRA runs ------------------------------------------------------------------------------


def lora_source(source: str | Path, flag: str):
    """The LoRA run checkpoint `source` and its `lora` section (`flag` names the option in
    the error when it is not one)."""
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
    model_source, lora = lora_source(source, "--merge-lora")
    merge = LoRAMerge(model_source, lora)
    to_hf = OursToHF(model_source.config, merge.shapes)
    entries = [(hf, dtype or d, shape) for hf, (d, shape) in to_hf.shapes.items()]
    shards = plan_shards(entries, max_shard_size)
    needed = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)
    with staged_output(output, needed) as tmp:
        writer = ShardedWriter(tmp, entries, shards, dtype)
        bar = progress(len(merge.shapes), "merge lora -> hf")

        def put(name: str, tensor: torch.Tensor) -> None:
            bar.update(1)
            for hf, made in to_hf.put(name, tensor):
                writer.write(hf, made)

        with writer, bar:
            merge.stream(put)
        write_hf_config(model_source, tmp, entries)
    logger.info("wrote %s (LoRA merged, %d tensors)", output, len(entries))
    return Path(output)
