"""MiniMax-M2 in Hugging Face's spelling (`MiniMaxM2ForCausalLM`, model_type minimax_m2).

config.json: the shared decoder keys plus `rotary_dim` (the published config's spelling)
or `partial_rotary_factor` (v5's `rope_parameters`); `num_local_experts` routed experts of
`intermediate_size` in every block, top-`num_experts_per_tok` by sigmoid scores plus the
`e_score_correction_bias`, weights renormalised, no scaling, no expert groups, no shared
expert (`shared_intermediate_size` 0); a q/k RMSNorm over all heads (`qk_norm_type`
"per_layer", our `qk_norm_scope="all"`). Refused, naming the key: another `scoring_func`,
a shared expert, router jitter, linear-attention layers (`attn_type_list` other than 1).
The multi-token prediction modules (`use_mtp`, `num_mtp_modules`) are not built: as in
transformers, checkpoint layers past num_hidden_layers are skipped on reading, and none are
written.

Weights: Mixtral's checkpoint names (`block_sparse_moe.gate`,
`block_sparse_moe.experts.E.{w1,w3,w2}`) plus `block_sparse_moe.e_score_correction_bias`,
or transformers v5's in-memory `mlp.*` (fused experts, `mlp.e_score_correction_bias`);
`self_attn.q_norm` / `k_norm` are num_heads x head_dim and num_kv_heads x head_dim wide.
RoPE rotates half of each head as GLM-4.5 does, so the q/k rows (and the qk-norm weights,
head by head) are permuted as there (`glm4_moe.hf.permute_qk_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.common.moe_hf_adapter import W1_W3_W2, MoEAdapter
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.glm4_moe.hf import permute_qk_rows, pop_partial_rotary, rotary_dim_of
from mindspeed_llm.models.hf_format import HFFormat

_FIXED = {
    "qk_norm": True,
    "qk_norm_scope": "all",
    "qkv_bias": False,
    "router_score": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_expert_groups": 1,
    "shared_expert_intermediate_size": 0,
    "mlp_only_layers": (),
    "decoder_sparse_step": 1,
    "num_nextn_predict_layers": 0,
}
"""What every MiniMax-M2 is: our fields read from any of its configs, and required to
write one."""
_DEFAULT_THETA = 5000000.0  # transformers' MiniMaxM2Config.default_theta


def _check(hf: dict[str, Any]) -> None:
    """Refuse MiniMax options we do not build, naming the key."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func={hf['scoring_func']!r} is not supported (only 'sigmoid')")
    if hf.get("shared_intermediate_size"):
        raise ConfigError(
            f"shared_intermediate_size={hf['shared_intermediate_size']} is not supported (only 0)"
        )
    if hf.get("router_jitter_noise"):
        raise ConfigError("router_jitter_noise > 0 is not supported")
    if any(kind != 1 for kind in hf.get("attn_type_list") or ()):
        raise ConfigError("attn_type_list with linear-attention layers (0) is not supported")
    if hf.get("qk_norm_type", "per_layer") != "per_layer":
        raise ConfigError(f"qk_norm_type={hf['qk_norm_type']!r} is not supported (only 'per_layer')")


def _read_experts(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **_FIXED,
        "num_experts": hf.get("num_local_experts", 256),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": hf["intermediate_size"],
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


def _write_experts(config: TransformerConfig) -> dict[str, Any]:
    """Raises ConfigError for a config MiniMax-M2's keys cannot say (see `_FIXED`)."""
    for field, value in _FIXED.items():
        if getattr(config, field) != value:
            raise ConfigError(
                f"{field}={getattr(config, field)!r} cannot be written as minimax_m2 "
                f"(it has {value!r})"
            )
    return {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,  # the experts' width
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "shared_intermediate_size": 0,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
    }


_BASE = decoder_format(
    "minimax_m2",
    "MiniMaxM2ForCausalLM",
    experts=HFKeys(read=_read_experts, write=_write_experts),
)


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    _check(hf)
    hf, factor = pop_partial_rotary(hf, 1.0)
    rotary_dim = hf.pop("rotary_dim", None)
    if not hf.get("rope_parameters") and "rope_theta" not in hf:
        hf["rope_theta"] = _DEFAULT_THETA
    fields = _BASE.read(hf)
    head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_heads"]
    if rotary_dim is None:
        fields["rotary_dim"] = rotary_dim_of(fields, factor)
    else:
        fields["rotary_dim"] = None if rotary_dim == head_dim else rotary_dim
    return fields


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = _BASE.write(config)
    out.pop("sliding_window")
    out["rotary_dim"] = config.rotary_dim or config.head_dim
    return out


FORMAT = HFFormat(
    model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM", read=_read, write=_write
)


@dataclass(frozen=True)
class MiniMaxM2Adapter(MoEAdapter):
    """MiniMax-M2's `hf_adapter`: Mixtral's expert names plus the balancing bias, q/k rows
    permuted for partial RoPE, MTP layers skipped (see the module docstring)."""

    def name_map(self, config: TransformerConfig, *, fused: bool = False) -> dict[str, str]:
        names = super().name_map(config, fused=fused)
        for i in range(config.num_layers):
            if config.is_moe_layer(i):
                prefix = self._prefix(i, fused)
                names[f"layers.{i}.feed_forward.router.expert_bias"] = (
                    f"{prefix}.e_score_correction_bias"
                )
        return names

    def to_hf(
        self, state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        return permute_qk_rows(super().to_hf(state_dict, config), config, to_hf=True)

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        kept = {k: v for k, v in hf_state_dict.items() if not _is_mtp(k, config)}
        return super().from_hf(permute_qk_rows(kept, config, to_hf=False), config)


def _is_mtp(name: str, config: TransformerConfig) -> bool:
    """A tensor of a layer past num_hidden_layers (MiniMax's MTP modules)."""
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= config.num_layers


ADAPTER = MiniMaxM2Adapter(expert_names=dict(W1_W3_W2), block="block_sparse_moe")
