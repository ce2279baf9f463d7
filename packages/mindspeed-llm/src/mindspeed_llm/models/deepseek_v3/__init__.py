"""DeepSeek-V3: the shared decoder with multi-head latent attention (`common.mla`), sigmoid
routing over expert groups with ungated shared experts, dense first blocks, and
multi-token prediction modules (`common.mtp`); sizes in flavors.py, Hugging Face spelling
and weight names in hf.py. Multi-head latent attention has no tensor or context parallel
plan yet; pipeline and expert parallel work (MTP modules only with pp=1)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.deepseek_v3 import flavors, hf

SPEC = decoder_family("deepseek_v3", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
