"""Qwen3.5 (dense, text): Qwen3-Next's hybrid decoder (gated DeltaNet blocks beside gated
attention) with dense feed-forward blocks and its linear blocks' inputs spelled as four
projections (hf.py). The multimodal checkpoints' config reads as their language model."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen3_5 import flavors, hf

SPEC = decoder_family("qwen3_5", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
