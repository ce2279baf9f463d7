"""The decoder every family shares, dense or MoE: norm, RoPE, attention, feed-forward,
experts, the decoder, the tensor-parallel plan and the parallelisation recipe, and the
Hugging Face machinery (`hf_config` for config.json, `hf_adapter` / `moe_hf_adapter` for
weight names) a family's `hf.py` configures."""

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
