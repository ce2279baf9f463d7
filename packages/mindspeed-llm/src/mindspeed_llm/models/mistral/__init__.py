"""The mistral family: the shared dense decoder with mistral's flags (see flavors.py)."""

from mindspeed_llm.models.common import (
    Transformer,
    hf_adapter,
    parallelize_decoder,
    pipeline_decoder,
)
from mindspeed_llm.models.mistral.flavors import FLAVORS
from mindspeed_llm.models.registry import ModelSpec

SPEC = ModelSpec(
    name="mistral",
    flavors=FLAVORS,
    build=Transformer,
    parallelize=parallelize_decoder,
    pipeline=pipeline_decoder,
    hf_adapter=hf_adapter,
)

__all__ = ["FLAVORS", "SPEC"]
