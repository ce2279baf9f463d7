"""Qwen2-MoE: Qwen2's decoder with routed experts and a gated shared expert (sizes in
flavors.py, Hugging Face spelling and expert names in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen2_moe import flavors, hf

SPEC = decoder_family("qwen2_moe", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
