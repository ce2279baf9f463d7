"""Llama 2 / 3: the shared dense decoder (sizes in flavors.py, Hugging Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.llama import flavors, hf

SPEC = decoder_family("llama", flavors.FLAVORS, hf.FORMAT)
