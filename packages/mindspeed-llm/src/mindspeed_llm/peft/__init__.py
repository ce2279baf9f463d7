"""Parameter-efficient fine-tuning: LoRA adapters (and QLoRA's NF4 base) written for our
decoder and its tensor-parallel layout (peft is a test-only oracle)."""

from mindspeed_llm.peft.lora import (
    HF_NAMES,
    LoRAConfig,
    adapted_modules,
    adapters_disabled,
    apply_lora,
    lora_trainer_options,
    lora_transform,
    merge_lora,
    merged_state,
)

__all__ = [
    "HF_NAMES",
    "LoRAConfig",
    "adapted_modules",
    "adapters_disabled",
    "apply_lora",
    "lora_trainer_options",
    "lora_transform",
    "merge_lora",
    "merged_state",
]
