"""Mixtral: the shared decoder with routed experts (sizes in flavors.py, Hugging Face
spelling and expert names in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.mixtral import flavors, hf

SPEC = decoder_family("mixtral", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
