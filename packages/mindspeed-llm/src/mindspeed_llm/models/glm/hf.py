"""GLM-4-9B-chat in Hugging Face's spelling (`GlmForCausalLM`, model_type `glm`).

config.json: as `glm4` (the shared decoder keys, `partial_rotary_factor` at the top level
in v4 or inside `rope_parameters` in v5, `attention_bias` for q/k/v only). Weights: the
dense adapter's names (no post norms: `post_attention_layernorm` is the norm before the
MLP, as in Llama), `mlp.gate_up_proj` split into gate and up, and q/k rows permuted
within each head between GLM's interleaved RoPE pairs and ours (`glm4.hf`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.glm4.hf import (
    from_glm_rows,
    read_partial_rotary,
    to_glm_rows,
    write_partial_rotary,
)
from mindspeed_llm.models.hf_format import HFFormat
from mindspeed_llm.models.phi3 import hf as phi3_hf

_BASE = decoder_format("glm", "GlmForCausalLM", flags={"qkv_bias": True})

FORMAT = HFFormat(
    model_type="glm",
    architecture="GlmForCausalLM",
    read=lambda hf: read_partial_rotary(_BASE, hf),
    write=lambda config: write_partial_rotary(_BASE, config),
)


class GlmAdapter:
    """GLM's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    @staticmethod
    def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        out = to_glm_rows(hf_adapter.to_hf(state_dict, config), config)
        return phi3_hf.fuse(out, config, qkv=False)

    @staticmethod
    def from_hf(
        hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        split = from_glm_rows(phi3_hf.split(hf_state_dict, config, qkv=False), config)
        return hf_adapter.from_hf(split, config)


ADAPTER = GlmAdapter()
