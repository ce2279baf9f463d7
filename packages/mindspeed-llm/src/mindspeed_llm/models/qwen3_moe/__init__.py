"""The qwen3_moe family: the shared decoder with MoE blocks (see flavors.py)."""

from mindspeed_llm.models.common import Transformer, moe_hf_adapter, parallelize_decoder
from mindspeed_llm.models.qwen3_moe.flavors import FLAVORS
from mindspeed_llm.models.registry import ModelSpec

SPEC = ModelSpec(
    name="qwen3_moe",
    flavors=FLAVORS,
    build=Transformer,
    parallelize=parallelize_decoder,
    hf_adapter=moe_hf_adapter,
)

__all__ = ["FLAVORS", "SPEC"]
