"""Adapter tensor names: ours (`layers.0.attention.wq.lora_A.weight`) <-> peft's file names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), through the family's
Hugging Face name map of the base weight."""

from __future__ import annotations

from mindspeed_core.errors import CheckpointError
from mindspeed_llm.models import get_model_spec
from mindspeed_llm.models.config import TransformerConfig

PEFT_PREFIX = "base_model.model."
"""What peft's `PeftModelForCausalLM` puts before the Hugging Face module path."""
_FACTORS = ("lora_A", "lora_B")
EXPERT_ADAPTERS = ".experts.adapters."
"""In the name of a routed expert's adapter (`layers.1.feed_forward.experts.adapters.w1.lora_A`)."""


def to_peft_names(keys, config: TransformerConfig) -> dict[str, str]:
    """Our adapter keys -> peft's saved names (adapter name left out, as peft saves them).

    Raises:
        CheckpointError: a key is not an adapter of a layer the family can name, or one of
            routed experts (see `peft_experts`: not tensor for tensor).
    """
    hf = get_model_spec(config.family).hf_adapter.name_map(config)
    out = {}
    for key in keys:
        if EXPERT_ADAPTERS in key:
            # peft adapts transformers' fused gate_up_proj with one A for gate and up: ours
            # are fused, not renamed (`peft_experts.peft_expert_adapters`)
            raise CheckpointError(f"{key}: an expert adapter has no peft name of its own")
        module, factor, leaf = key.rsplit(".", 2)
        base = hf.get(f"{module}.weight")
        if factor not in _FACTORS or leaf != "weight" or base is None:
            raise CheckpointError(f"{key} is not a LoRA adapter tensor of a {config.family} layer")
        out[key] = f"{PEFT_PREFIX}{base.removesuffix('.weight')}.{factor}.weight"
    return out


def hf_module_names(module_names, config: TransformerConfig) -> list[str]:
    """Hugging Face leaf names (q_proj, ...) of our adapted modules, sorted, for target_modules."""
    hf = get_model_spec(config.family).hf_adapter.name_map(config)
    return sorted(
        {hf[f"{m}.weight"].removesuffix(".weight").rsplit(".", 1)[-1] for m in module_names}
    )
