"""Qwen3.5-MoE sizes: a debug model (published checkpoints are multimodal; `from_hf` reads
their language model's config from `text_config`)."""

from dataclasses import replace

from mindspeed_llm.models.qwen3_next.flavors import FLAVORS as NEXT

FLAVORS = {"debug": replace(NEXT["debug"], family="qwen3_5_moe")}
