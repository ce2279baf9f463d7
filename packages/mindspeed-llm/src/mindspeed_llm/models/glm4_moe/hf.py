"""GLM-4.5 / 4.6 in Hugging Face's spelling (`Glm4MoeForCausalLM`, model_type glm4_moe).

config.json: the shared decoder keys plus `partial_rotary_factor` (top level in v4, inside
`rope_parameters` in v5; default 0.5 as transformers), `attention_bias` (q/k/v only),
`use_qk_norm` (per head), the routed experts as DeepSeek-V3 spells them
(`n_routed_experts`, `n_shared_experts` of `moe_intermediate_size`, `n_group` /
`topk_group`, `routed_scaling_factor`, `norm_topk_prob`; sigmoid scores with the
`e_score_correction_bias`), `first_k_dense_replace` dense blocks of `intermediate_size`,
and `num_nextn_predict_layers` MTP modules.

Weights: DeepSeek-V3's names (`deepseek_v3.hf`: per-expert or transformers v5's fused
experts, `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`, MTP module k as
`model.layers.{num_hidden_layers + k}` with its `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` and copies of the embedding and head) with Llama's attention names
(`q/k/v_proj` and their biases, `q_norm` / `k_norm`). The q/k rows (weights, biases and
qk-norm weights) are permuted within each head: GLM-4.5 rotates pairs
(j, j + rotary_dim / 2) of the first rotary_dim channels and passes the rest through, ours
pairs (i, i + head_dim / 2) with zero frequency past rotary_dim; one permutation of q and
k channels leaves every attention score unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.deepseek_v3.hf import DeepseekV3Adapter
from mindspeed_llm.models.hf_format import HFFormat

# -- config.json --------------------------------------------------------------------------


def pop_partial_rotary(hf: dict[str, Any], default: float) -> tuple[dict[str, Any], float]:
    """(hf without `partial_rotary_factor`, the factor) from v5's `rope_parameters` or v4's
    top-level key."""
    hf, rope = dict(hf), dict(hf.get("rope_parameters") or {})
    factor = rope.pop("partial_rotary_factor", None) or hf.pop("partial_rotary_factor", default)
    hf.pop("partial_rotary_factor", None)
    if hf.get("rope_parameters"):
        hf["rope_parameters"] = rope
    return hf, factor


def rotary_dim_of(fields: dict[str, Any], factor: float) -> int | None:
    """Our `rotary_dim` (None: the whole head) for a partial_rotary_factor."""
    head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_heads"]
    rotary_dim = int(head_dim * factor)
    return None if rotary_dim == head_dim else rotary_dim


def _read_experts(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func={hf['scoring_func']!r} is not supported (only 'sigmoid')")
    groups, width = hf.get("n_group") or 1, hf.get("moe_intermediate_size", 1408)
    first_dense = hf.get("first_k_dense_replace", 1)
    return {
        "num_experts": hf.get("n_routed_experts") or hf.get("num_local_experts") or 128,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * (hf.get("n_shared_experts", 1) or 0),
        "shared_expert_gated": False,
        "router_score": "sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
        "num_expert_groups": groups,
        "topk_expert_groups": hf.get("topk_group") or groups,
        "mlp_only_layers": tuple(range(min(first_dense, hf["num_hidden_layers"]))),
        "num_nextn_predict_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)),
    }


def _write_experts(config: TransformerConfig) -> dict[str, Any]:
    """Raises ConfigError for what GLM-4.5 cannot spell: dense blocks other than the first
    ones, a gated shared expert or one not a multiple of the experts' width."""
    first_dense = len(config.mlp_only_layers)
    if config.mlp_only_layers != tuple(range(first_dense)) or config.decoder_sparse_step != 1:
        raise ConfigError(
            f"mlp_only_layers={config.mlp_only_layers} must be the first blocks for glm4_moe"
        )
    shared, width = config.shared_expert_intermediate_size, config.moe_intermediate_size
    if shared % width or config.shared_expert_gated:
        raise ConfigError(
            f"shared_expert_intermediate_size={shared} must be ungated and a multiple of "
            f"moe_intermediate_size={width} for glm4_moe"
        )
    return {
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width,
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "n_group": config.num_expert_groups,
        "topk_group": config.topk_expert_groups,
        "first_k_dense_replace": first_dense,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
    }


_BASE = decoder_format(
    "glm4_moe", "Glm4MoeForCausalLM", extra=HFKeys(read=_read_experts, write=_write_experts)
)


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    hf, factor = pop_partial_rotary(hf, 0.5)
    qkv_bias = bool(hf.pop("attention_bias", False))  # q/k/v only: o_proj has none
    fields = _BASE.read(hf)
    fields.update(
        qkv_bias=qkv_bias,
        qk_norm=bool(hf.get("use_qk_norm", False)),
        rotary_dim=rotary_dim_of(fields, factor),
    )
    return fields


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = _BASE.write(config)
    out.pop("sliding_window")
    out["partial_rotary_factor"] = (config.rotary_dim or config.head_dim) / config.head_dim
    out["attention_bias"] = config.qkv_bias
    out["use_qk_norm"] = config.qk_norm
    return out


FORMAT = HFFormat(model_type="glm4_moe", architecture="Glm4MoeForCausalLM", read=_read, write=_write)

# -- weights ------------------------------------------------------------------------------

_QK_ROWS = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_(proj|norm)\.(weight|bias)")


def partial_rotary_index(config: TransformerConfig) -> Tensor:
    """Channel index within a head, ours[r] = theirs[index[r]], between rotate-half RoPE on
    the first rotary_dim channels (GLM-4.5, MiniMax-M2) and ours (pairs (i, i + head_dim / 2),
    zero frequency past rotary_dim / 2)."""
    hd, rd = config.head_dim, config.rotary_dim or config.head_dim
    half, pass_half = hd // 2, (hd - rd) // 2
    index = [0] * hd
    for j in range(rd // 2):  # rotated pairs (j, j + rd / 2) -> (j, j + half)
        index[j], index[j + half] = j, j + rd // 2
    for m in range(pass_half):  # the pass-through channels, in order
        index[rd // 2 + m], index[rd // 2 + m + half] = rd + m, rd + pass_half + m
    return torch.tensor(index)


def permute_qk_rows(
    sd: Mapping[str, Tensor], config: TransformerConfig, *, to_hf: bool
) -> dict[str, Tensor]:
    """`sd` (Hugging Face names) with the q/k rows of every layer (projection weights and
    biases, qk-norm weights per head or over all heads) moved between the checkpoint's
    RoPE pairing and ours: to ours, or back (`to_hf`)."""
    if config.rotary_dim is None:
        return dict(sd)
    index = partial_rotary_index(config)
    if to_hf:
        index = torch.argsort(index)
    out = dict(sd)
    for name, tensor in sd.items():
        if _QK_ROWS.fullmatch(name):
            heads = tensor.shape[0] // config.head_dim  # 1 for a per-head norm weight
            rows = (torch.arange(heads)[:, None] * config.head_dim + index[None, :]).flatten()
            out[name] = tensor[rows]
    return out


def _attention_names(config: TransformerConfig) -> dict[str, str]:
    """Our name -> Hugging Face name of a block's attention and its two norms (Llama's)."""
    names = {k: v for k, v in hf_adapter._LAYER.items() if not k.startswith("feed_forward.")}
    if config.qkv_bias:
        names.update(hf_adapter._QKV_BIAS)
    if config.qk_norm:
        names.update(hf_adapter._QK_NORM)
    return names


@dataclass(frozen=True)
class Glm4MoeAdapter:
    """GLM-4.5's `hf_adapter`: DeepSeek-V3's expert and MTP names, Llama's attention names,
    q/k rows permuted (see the module docstring)."""

    names: DeepseekV3Adapter = DeepseekV3Adapter(attention=_attention_names)

    def to_hf(
        self, state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        return permute_qk_rows(self.names.to_hf(state_dict, config), config, to_hf=True)

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        return self.names.from_hf(permute_qk_rows(hf_state_dict, config, to_hf=False), config)


ADAPTER = Glm4MoeAdapter()
