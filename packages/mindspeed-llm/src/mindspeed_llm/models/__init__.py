"""Model architectures: one dense decoder, its config, and a registry of families.

from mindspeed_llm.models import build_model_config, get_model_spec

config = build_model_config("llama", flavor="debug")
spec = get_model_spec(config.family)
model = spec.parallelize(spec.build(config), dims)
"""

from mindspeed_llm.models import llama, mistral, qwen2, qwen3
from mindspeed_llm.models.common import Transformer
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.registry import (
    ModelSpec,
    build_model_config,
    get_model_spec,
    model_families,
    register_model,
)

for _family in (llama, qwen2, qwen3, mistral):
    register_model(_family.SPEC)

__all__ = [
    "ModelSpec",
    "Transformer",
    "TransformerConfig",
    "build_model_config",
    "get_model_spec",
    "model_families",
    "register_model",
]
