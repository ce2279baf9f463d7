"""GLM-4 in Hugging Face's spelling (`Glm4ForCausalLM`).

config.json: the shared decoder keys plus `partial_rotary_factor` (top level in v4, inside
`rope_parameters` in v5) and `attention_bias` (q/k/v only). Weights: the dense adapter's
names with `post_norms`, after three renames (GLM's `post_self_attn_layernorm`,
`post_attention_layernorm` (before the MLP) and `post_mlp_layernorm` are Gemma 2's
`post_attention_layernorm`, `pre_feedforward_layernorm` and `post_feedforward_layernorm`),
`mlp.gate_up_proj` split into gate and up, and the q/k rows (weights and biases) permuted
within each head: GLM rotates interleaved pairs (2j, 2j + 1) of the first rotary_dim
channels, ours rotates pairs (i, i + head_dim / 2) with zero frequency past rotary_dim, and
a permutation of q and k channels applied to both leaves every attention score unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat
from mindspeed_llm.models.phi3 import hf as phi3_hf

_BASE = decoder_format("glm4", "Glm4ForCausalLM", flags={"post_norms": True, "qkv_bias": True})
_NORMS = {  # GLM-4's name -> the dense adapter's (post_norms) name, per layer
    "post_self_attn_layernorm.weight": "post_attention_layernorm.weight",
    "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
}


def read_partial_rotary(base: HFFormat, hf: dict[str, Any]) -> dict[str, Any]:
    """`base.read` plus `rotary_dim` from `partial_rotary_factor` (default 0.5, as GLM's
    configs); q/k/v biases are required (`attention_bias` false refused)."""
    hf = dict(hf)
    rope = dict(hf.get("rope_parameters") or {})
    factor = rope.pop("partial_rotary_factor", None) or hf.pop("partial_rotary_factor", 0.5)
    hf.pop("partial_rotary_factor", None)
    if rope:
        hf["rope_parameters"] = rope
    if not hf.get("attention_bias", True):
        raise ConfigError(f"{base.model_type} with attention_bias=false is not supported")
    hf.pop("attention_bias", None)
    fields = base.read(hf)
    head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_heads"]
    rotary_dim = int(head_dim * factor)
    fields["rotary_dim"] = None if rotary_dim == head_dim else rotary_dim
    return fields


def write_partial_rotary(base: HFFormat, config: TransformerConfig) -> dict[str, Any]:
    """`base.write` plus `partial_rotary_factor` and `attention_bias` (q/k/v only)."""
    out = base.write(config)
    out["partial_rotary_factor"] = (config.rotary_dim or config.head_dim) / config.head_dim
    out["attention_bias"] = True
    return out


FORMAT = HFFormat(
    model_type="glm4",
    architecture="Glm4ForCausalLM",
    read=lambda hf: read_partial_rotary(_BASE, hf),
    write=lambda config: write_partial_rotary(_BASE, config),
)


def _pairing(config: TransformerConfig) -> Tensor:
    """Row index over q (or k) rows: ours[r] = GLM's[index[r]], head by head."""
    hd, rd = config.head_dim, config.rotary_dim or config.head_dim
    half, perm = hd // 2, [0] * hd
    for j in range(rd // 2):  # rotated pairs (2j, 2j + 1) -> (j, j + half)
        perm[j], perm[j + half] = 2 * j, 2 * j + 1
    for m in range((hd - rd) // 2):  # the pass-through channels, paired the same way
        perm[rd // 2 + m], perm[rd // 2 + m + half] = rd + 2 * m, rd + 2 * m + 1
    return torch.tensor(perm)


def _permute(tensor: Tensor, index: Tensor, config: TransformerConfig) -> Tensor:
    heads = tensor.shape[0] // config.head_dim
    rows = (torch.arange(heads)[:, None] * config.head_dim + index[None, :]).flatten()
    return tensor[rows]


def _qk_names(config: TransformerConfig):
    for i in range(config.num_layers):
        for proj in ("q_proj", "k_proj"):
            for kind in ("weight", "bias"):
                yield f"model.layers.{i}.self_attn.{proj}.{kind}"


def _rename(sd: Mapping[str, Tensor], table: Mapping[str, str]) -> dict[str, Tensor]:
    """`model.layers.N.<name>` -> `model.layers.N.<table[name]>` where the table has it."""
    out = {}
    for name, tensor in sd.items():
        head, dot, tail = name.partition(".layers.")
        layer, _, rest = tail.partition(".")
        out[f"{head}.layers.{layer}.{table[rest]}" if dot and rest in table else name] = tensor
    return out


def to_glm_rows(hf_state_dict: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """q/k rows (weights and biases) in our RoPE pairing -> GLM's, in place of the dict."""
    inverse = torch.argsort(_pairing(config))
    for name in _qk_names(config):
        hf_state_dict[name] = _permute(hf_state_dict[name], inverse, config)
    return hf_state_dict


def from_glm_rows(hf_state_dict: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """q/k rows in GLM's interleaved RoPE pairing -> ours, in place of the dict (a missing
    tensor is left for the name check to report)."""
    index = _pairing(config)
    for name in _qk_names(config):
        if name in hf_state_dict:
            hf_state_dict[name] = _permute(hf_state_dict[name], index, config)
    return hf_state_dict


class Glm4Adapter:
    """GLM-4's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    @staticmethod
    def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        out = _rename(hf_adapter.to_hf(state_dict, config), {v: k for k, v in _NORMS.items()})
        return phi3_hf.fuse(to_glm_rows(out, config), config, qkv=False)

    @staticmethod
    def from_hf(
        hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        split = _rename(phi3_hf.split(hf_state_dict, config, qkv=False), _NORMS)
        return hf_adapter.from_hf(from_glm_rows(split, config), config)


ADAPTER = Glm4Adapter()
