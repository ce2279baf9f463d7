"""Model architectures: one decoder (dense or MoE), its config, and a registry of families.

from mindspeed_llm.models import build_model_config, get_model_spec

config = build_model_config("llama", flavor="debug")
spec = get_model_spec(config.family)
model = spec.parallelize(spec.build(config), dims)

Each family folder holds `flavors.py` (named sizes) and `hf.py` (its Hugging Face spelling);
`mindspeed_llm.loading` loads a model from a Hugging Face folder or a MindSpeed checkpoint.
"""

from mindspeed_llm.models import (
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    gemma2,
    gemma3,
    glm,
    glm4,
    glm4_moe,
    gpt_oss,
    internlm2,
    internlm3,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from mindspeed_llm.models.common import Transformer
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.registry import (
    ModelSpec,
    build_model_config,
    get_model_spec,
    model_families,
    register_model,
    unregister_model,
)

for _family in (
    llama,
    qwen2,
    qwen3,
    mistral,
    mixtral,
    qwen2_moe,
    qwen3_moe,
    phi3,
    gemma2,
    gemma3,
    glm4,
    glm,
    glm4_moe,
    internlm3,
    internlm2,
    deepseek_v3,
    deepseek_v2,
    gpt_oss,
    deepseek_v32,
    minimax_m2,
    qwen3_next,
    qwen3_5,
    qwen3_5_moe,
):
    register_model(_family.SPEC)

__all__ = [
    "ModelSpec",
    "Transformer",
    "TransformerConfig",
    "build_model_config",
    "get_model_spec",
    "model_families",
    "register_model",
    "unregister_model",
]
