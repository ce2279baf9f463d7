"""Building blocks shared by the dense families: norm, RoPE, attention, feed-forward,
the decoder, the Hugging Face name mapping and the parallelisation recipe."""

from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.attention import Attention
from mindspeed_llm.models.common.feed_forward import FeedForward
from mindspeed_llm.models.common.norm import RMSNorm
from mindspeed_llm.models.common.parallelize import parallelize_decoder, pipeline_decoder
from mindspeed_llm.models.common.rope import rope_tables
from mindspeed_llm.models.common.transformer import Block, Transformer

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "hf_adapter",
    "parallelize_decoder",
    "pipeline_decoder",
    "rope_tables",
]
