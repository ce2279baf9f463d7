"""The llama family: the shared dense decoder with llama's flags (see flavors.py)."""

from mindspeed_llm.models.common import (
    Transformer,
    hf_adapter,
    parallelize_decoder,
    pipeline_decoder,
)
from mindspeed_llm.models.llama.flavors import FLAVORS
from mindspeed_llm.models.registry import ModelSpec

SPEC = ModelSpec(
    name="llama",
    flavors=FLAVORS,
    build=Transformer,
    parallelize=parallelize_decoder,
    pipeline=pipeline_decoder,
    hf_adapter=hf_adapter,
)

__all__ = ["FLAVORS", "SPEC"]
