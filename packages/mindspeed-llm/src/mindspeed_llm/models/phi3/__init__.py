"""Phi-3 / Phi-3.5: the shared dense decoder; Hugging Face fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`, which `hf.py` splits and fuses (sizes in flavors.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.phi3 import flavors, hf

SPEC = decoder_family("phi3", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
