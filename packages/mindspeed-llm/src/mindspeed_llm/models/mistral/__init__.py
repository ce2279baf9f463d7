"""Mistral: the shared dense decoder with a sliding window (sizes in flavors.py, Hugging
Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.mistral import flavors, hf

SPEC = decoder_family("mistral", flavors.FLAVORS, hf.FORMAT)
