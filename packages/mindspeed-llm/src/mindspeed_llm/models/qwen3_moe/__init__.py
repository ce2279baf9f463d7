"""Qwen3-MoE: Qwen3's decoder with routed experts (sizes in flavors.py, Hugging Face
spelling and expert names in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen3_moe import flavors, hf

SPEC = decoder_family("qwen3_moe", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
