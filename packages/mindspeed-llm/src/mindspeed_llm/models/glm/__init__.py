"""GLM-4 in transformers' `glm` form (GLM-4-9B-chat, `GlmForCausalLM`): the shared dense
decoder with q/k/v biases and RoPE on half of each head (`rotary_dim`), and no post norms
(unlike the 0414 `glm4` family); `hf.py` splits the fused gate/up and permutes q/k rows
between GLM's interleaved RoPE pairs and ours, as `glm4` does (sizes in flavors.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.glm import flavors, hf

SPEC = decoder_family("glm", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
