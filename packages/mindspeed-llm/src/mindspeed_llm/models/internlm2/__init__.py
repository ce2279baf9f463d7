"""InternLM2 / InternLM2.5 (remote code only; transformers has no class for it): the Llama
decoder with q, k and v fused in one `attention.wqkv` in InternLM2's grouped layout;
`hf.py` reads its config.json and splits / fuses wqkv (sizes in flavors.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.internlm2 import flavors, hf

SPEC = decoder_family("internlm2", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
