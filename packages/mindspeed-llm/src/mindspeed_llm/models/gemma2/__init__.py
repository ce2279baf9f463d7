"""Gemma 2: the shared dense decoder with Gemma's flags: GeGLU (gelu_tanh), (1 + w)
RMSNorms also after attention and the feed-forward, sqrt(hidden)-scaled tied embeddings,
query_pre_attn_scalar, soft-capped attention scores and logits, a sliding window on every
other block (sizes in flavors.py, Hugging Face spelling in hf.py)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.gemma2 import flavors, hf

SPEC = decoder_family("gemma2", flavors.FLAVORS, hf.FORMAT)
