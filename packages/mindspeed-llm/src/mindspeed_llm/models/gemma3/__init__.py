"""Gemma 3 (text): Gemma 2's decoder without soft caps, with (1 + w) q/k norms, five
sliding-window blocks per full one, and a local RoPE base for the windowed blocks (sizes in
flavors.py, Hugging Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.gemma3 import flavors, hf

SPEC = decoder_family("gemma3", flavors.FLAVORS, hf.FORMAT)
