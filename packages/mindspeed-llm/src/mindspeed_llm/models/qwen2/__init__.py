"""Qwen2 / Qwen2.5: the shared dense decoder with q/k/v biases (sizes in flavors.py,
Hugging Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen2 import flavors, hf

SPEC = decoder_family("qwen2", flavors.FLAVORS, hf.FORMAT)
