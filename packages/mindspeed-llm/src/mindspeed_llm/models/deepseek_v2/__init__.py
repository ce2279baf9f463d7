"""DeepSeek-V2 / V2-Lite: DeepSeek-V3's decoder (multi-head latent attention, ungated shared
experts, dense first blocks) with softmax routing, greedy or limited to the groups with
the best expert, scaled by routed_scaling_factor, no expert bias and no MTP; sizes in
flavors.py, Hugging Face spelling in hf.py. MoE models support neither pipeline nor
tensor parallel yet."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.deepseek_v2 import flavors, hf

SPEC = decoder_family(
    "deepseek_v2", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER, pipeline=False
)
