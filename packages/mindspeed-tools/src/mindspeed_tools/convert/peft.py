"""LoRA runs as a peft adapter folder (`--to peft`). Merged into Hugging Face weights
(`--to hf --merge-lora`) they are written by `mindspeed_llm.hf_export.merge_lora_to_hf`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mindspeed_llm.hf_export import lora_source
from mindspeed_llm.hf_export.staging import staged_output
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.peft.checkpoint import write_peft_adapter

logger = logging.getLogger("mindspeed.convert")


def lora_to_peft(source: str | Path, output: str | Path) -> Path:
    """adapter_config.json + adapter_model.safetensors of a LoRA run, for
    `peft.PeftModel.from_pretrained(base, output)`."""
    model, lora = lora_source(source, "--to peft")
    needed = sum(
        d.itemsize * torch.Size(s).numel() for d, s in ckpt.tensor_metadata(model.weights).values()
    )
    with staged_output(output, needed) as tmp:  # at most the step's model tensors
        write_peft_adapter(model.path, model.weights, model.config, lora, tmp)
    logger.info("wrote %s (peft adapter, rank %d)", output, lora.rank)
    return Path(output)
