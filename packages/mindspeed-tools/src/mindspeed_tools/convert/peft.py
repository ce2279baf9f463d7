"""LoRA runs: a Hugging Face folder with the adapters merged in (`LoRAMerge`, one base tensor
at a time), or a peft adapter folder."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mindspeed_core.errors import ConfigError
from mindspeed_llm.loading import checkpoint_source
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.peft.checkpoint import run_lora, write_peft_adapter
from mindspeed_tools.convert.hf import write_hf_config
from mindspeed_tools.convert.hf_out import OursToHF, ShardedWriter, plan_shards
from mindspeed_tools.convert.lora_merge import LoRAMerge
from mindspeed_tools.convert.staging import progress, staged_output

logger = logging.getLogger("mindspeed.convert")


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


def lora_to_peft(source: str | Path, output: str | Path) -> Path:
    """adapter_config.json + adapter_model.safetensors of a LoRA run, for
    `peft.PeftModel.from_pretrained(base, output)`."""
    model, lora = _lora_source(source, "--to peft")
    needed = sum(
        d.itemsize * torch.Size(s).numel() for d, s in ckpt.tensor_metadata(model.weights).values()
    )
    with staged_output(output, needed) as tmp:  # at most the step's model tensors
        write_peft_adapter(model.path, model.weights, model.config, lora, tmp)
    logger.info("wrote %s (peft adapter, rank %d)", output, lora.rank)
    return Path(output)
