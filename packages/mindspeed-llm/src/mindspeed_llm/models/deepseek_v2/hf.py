"""DeepSeek-V2 / V2-Lite in Hugging Face's spelling (`DeepseekV2ForCausalLM`, model_type
deepseek_v2).

config.json: DeepSeek-V3's latent attention and expert keys (`deepseek_v3.hf`), with V2's
routing: softmax scores (`scoring_func`), `topk_method` "greedy" (top-k over all experts)
or "group_limited_greedy" (only from the `topk_group` of `n_group` groups whose best score
is highest), no expert bias, weights times `routed_scaling_factor` and never renormalised
(`norm_topk_prob` true is refused: transformers ignores it and DeepSeek's own code then
skips the scaling, so the two disagree). RoPE is always interleaved; no MTP modules.
DeepSeek's sequence-wise aux loss (`aux_loss_alpha`, `seq_aux`) is not read.

Weights: DeepSeek-V3's names (the same adapter) without `e_score_correction_bias`.
"""

from __future__ import annotations

from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.deepseek_v3 import hf as v3

_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _check(hf: dict[str, Any]) -> None:
    """Refuse DeepSeek-V2 options we do not build, naming the key."""
    if hf.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(f"scoring_func={hf['scoring_func']!r} is not supported (only 'softmax')")
    if hf.get("topk_method", "greedy") not in _TOPK_METHODS:
        raise ConfigError(
            f"topk_method={hf['topk_method']!r} is not supported (only {', '.join(_TOPK_METHODS)})"
        )
    if hf.get("norm_topk_prob"):
        raise ConfigError(
            "norm_topk_prob=true is not supported for deepseek_v2 (transformers ignores it, "
            "DeepSeek's code then drops routed_scaling_factor)"
        )
    v3.check_weights_and_layers(hf)


def read_v2(hf: dict[str, Any]) -> dict[str, Any]:
    """Our fields for DeepSeek-V2's own config.json keys."""
    _check(hf)
    limited = hf.get("topk_method", "greedy") == "group_limited_greedy"
    groups = (hf.get("n_group") or 1) if limited else 1
    return {
        **v3.read_latent_moe(hf),
        "rope_interleaved": True,
        "router_score": "softmax",
        "norm_topk_prob": False,
        "num_expert_groups": groups,
        "topk_expert_groups": (hf.get("topk_group") or groups) if limited else 1,
        "expert_group_score": "max",
    }


def write_v2(config: TransformerConfig) -> dict[str, Any]:
    """DeepSeek-V2's own config.json keys from our config.

    Raises:
        ConfigError: a feature DeepSeek-V2's config cannot say (sigmoid or renormalised
            routing, rotate-half RoPE, MTP modules).
    """
    for name, value, wanted in (
        ("router_score", config.router_score, "softmax"),
        ("norm_topk_prob", config.norm_topk_prob, False),
        ("rope_interleaved", config.rope_interleaved, True),
        ("num_nextn_predict_layers", config.num_nextn_predict_layers, 0),
        ("expert_group_score", config.expert_group_score, "max"),
    ):
        if value != wanted:
            raise ConfigError(
                f"{name}={value!r} cannot be written for deepseek_v2 (only {wanted!r})"
            )
    groups = config.num_expert_groups
    return {
        **v3.write_latent_moe(config),
        "n_group": groups,
        "topk_group": config.topk_expert_groups,
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
    }


_BASE = decoder_format(
    "deepseek_v2", "DeepseekV2ForCausalLM", extra=HFKeys(read=read_v2, write=write_v2)
)


FORMAT = v3.latent_format(_BASE)
ADAPTER = v3.ADAPTER
