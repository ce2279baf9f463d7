"""Qwen3.5 dense sizes: a debug model (the published sizes are multimodal checkpoints whose
language model `from_hf` reads from their `text_config`)."""

from dataclasses import replace

from mindspeed_llm.models.qwen3_next.flavors import FLAVORS as NEXT

FLAVORS = {
    "debug": replace(NEXT["debug"], family="qwen3_5", num_experts=0, moe_intermediate_size=None,
                     shared_expert_intermediate_size=0),  # fmt: skip
}
