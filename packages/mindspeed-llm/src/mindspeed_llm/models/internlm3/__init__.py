"""InternLM3: the Llama decoder under its own model type (transformers builds it with its Llama
classes); its config.json may spell the biases `qkv_bias` / `bias`, which must be false here
(sizes in flavors.py, Hugging Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.internlm3 import flavors, hf

SPEC = decoder_family("internlm3", flavors.FLAVORS, hf.FORMAT)
