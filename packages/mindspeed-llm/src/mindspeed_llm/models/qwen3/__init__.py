"""The qwen3 family: the shared dense decoder with qwen3's flags (see flavors.py)."""

from mindspeed_llm.models.common import (
    Transformer,
    hf_adapter,
    parallelize_decoder,
    pipeline_decoder,
)
from mindspeed_llm.models.qwen3.flavors import FLAVORS
from mindspeed_llm.models.registry import ModelSpec

SPEC = ModelSpec(
    name="qwen3",
    flavors=FLAVORS,
    build=Transformer,
    parallelize=parallelize_decoder,
    pipeline=pipeline_decoder,
    hf_adapter=hf_adapter,
)

__all__ = ["FLAVORS", "SPEC"]
