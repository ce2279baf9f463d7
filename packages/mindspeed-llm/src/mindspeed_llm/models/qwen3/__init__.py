"""Qwen3: the shared dense decoder with per-head q/k norms (sizes in flavors.py, Hugging
Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen3 import flavors, hf

SPEC = decoder_family("qwen3", flavors.FLAVORS, hf.FORMAT)
