"""Qwen3-Next: a hybrid decoder, three gated DeltaNet (linear attention) blocks to each gated
softmax-attention block, zero-centred RMSNorms, partial RoPE, and very sparse routed experts
with a gated shared expert (sizes in flavors.py, Hugging Face spelling and weight names in
hf.py). Layouts: fsdp, tp (+SP; the linear blocks split by key-head group), ep, pp and cp (ring or
ulysses, whole rows; the linear blocks' state passed along the zig-zag chunks)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.qwen3_next import flavors, hf

SPEC = decoder_family("qwen3_next", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
