"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention, a lightning indexer choosing
each query's top-k keys for the latent attention (`common.mla`); sizes in flavors.py,
Hugging Face spelling and weight names in hf.py. Layouts as DeepSeek-V3 (tp, pp, ep); the
sparse attention is refused under context parallel."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.deepseek_v32 import flavors, hf

SPEC = decoder_family("deepseek_v32", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
