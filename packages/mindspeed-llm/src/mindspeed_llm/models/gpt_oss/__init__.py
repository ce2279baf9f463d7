"""gpt-oss (OpenAI): the shared decoder with attention sinks, q/k/v/o biases, sliding-window
blocks alternating with full ones, YaRN RoPE, and routed experts with a biased router,
biased experts and a clamped SwiGLU (sizes in flavors.py, Hugging Face spelling and weight
names in hf.py). Every layout works: tp (+SP; sinks sharded by head), ep, pp, cp (sinks
merged once in the ring)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.gpt_oss import flavors, hf

SPEC = decoder_family("gpt_oss", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
