"""Qwen3.5-MoE (text): Qwen3.5's hybrid decoder with Qwen3-Next's routed experts and gated
shared expert (hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen3_5_moe import flavors, hf

SPEC = decoder_family("qwen3_5_moe", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
