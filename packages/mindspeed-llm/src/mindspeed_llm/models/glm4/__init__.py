"""GLM-4 (the 0414 series, transformers' `glm4`): the shared dense decoder with q/k/v biases,
RMSNorms also on the attention and feed-forward outputs (as Gemma 2 places them), RoPE on
half of each head (`rotary_dim`), and fused gate/up in Hugging Face's names; `hf.py` renames
the norms, splits and fuses gate/up, and permutes q/k rows between GLM's interleaved RoPE
pairs and ours (sizes in flavors.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.glm4 import flavors, hf

SPEC = decoder_family("glm4", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
