"""The checks of a `TransformerConfig` that belong to one kind of model (MoE, latent and
sparse attention, linear attention, Gemma, gpt-oss): each names the field and the value it
refuses (`ConfigError`). `TransformerConfig.__post_init__` runs the general ones itself,
then `check_families`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mindspeed_core.errors import ConfigError

if TYPE_CHECKING:
    from mindspeed_llm.models.config import TransformerConfig

ROUTER_SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
ACTS = ("silu", "gelu_tanh")


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def check_families(cfg: TransformerConfig) -> None:
    """Every family-specific check, in the order they depend on each other."""
    check_gemma(cfg)
    check_moe(cfg)
    check_mla(cfg)
    check_gpt_oss(cfg)
    check_linear_attention(cfg)
    check_sparse_attention(cfg)


def check_linear_attention(cfg: TransformerConfig) -> None:
    cfg.linear_attention_layers = tuple(cfg.linear_attention_layers)
    if not cfg.linear_attention_layers:
        return
    bad = [i for i in cfg.linear_attention_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise ConfigError(f"linear_attention_layers {bad} are not blocks of {cfg.num_layers}")
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):  # fmt: skip
        check_positive_int(name, getattr(cfg, name))
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"linear_num_key_heads={cfg.linear_num_key_heads} must divide "
            f"linear_num_value_heads={cfg.linear_num_value_heads}"
        )
    if cfg.kv_lora_rank is not None:
        raise ConfigError("linear_attention_layers are not supported with kv_lora_rank")


def check_sparse_attention(cfg: TransformerConfig) -> None:
    if not isinstance(cfg.index_topk, int) or cfg.index_topk < 0:
        raise ConfigError(f"index_topk={cfg.index_topk!r} must be an integer >= 0")
    if not isinstance(cfg.index_loss_scale, int | float) or cfg.index_loss_scale < 0:
        raise ConfigError(f"index_loss_scale={cfg.index_loss_scale!r} must be a number >= 0")
    if not cfg.index_topk:
        return
    if cfg.kv_lora_rank is None or cfg.q_lora_rank is None:
        raise ConfigError("index_topk (DeepSeek sparse attention) needs latent attention "
                          "with a low-rank query (kv_lora_rank and q_lora_rank)")  # fmt: skip
    check_positive_int("index_n_heads", cfg.index_n_heads)
    check_positive_int("index_head_dim", cfg.index_head_dim)
    if cfg.index_head_dim <= cfg.qk_rope_head_dim:
        raise ConfigError(
            f"index_head_dim={cfg.index_head_dim} must exceed qk_rope_head_dim="
            f"{cfg.qk_rope_head_dim} (the indexer rotates that many of its channels)"
        )


def check_gpt_oss(cfg: TransformerConfig) -> None:
    if cfg.swiglu_limit is not None and (
        not isinstance(cfg.swiglu_limit, int | float) or cfg.swiglu_limit <= 0
    ):
        raise ConfigError(f"swiglu_limit={cfg.swiglu_limit!r} must be a positive number or None")
    if not isinstance(cfg.swiglu_alpha, int | float) or cfg.swiglu_alpha <= 0:
        raise ConfigError(f"swiglu_alpha={cfg.swiglu_alpha!r} must be a positive number")
    for name in ("router_bias", "expert_bias", "swiglu_limit"):
        if getattr(cfg, name) not in (None, False) and not cfg.num_experts:
            raise ConfigError(f"{name} needs routed experts (num_experts > 0)")
    if cfg.kv_lora_rank is not None and (cfg.attention_sinks or cfg.attention_out_bias):
        name = "attention_sinks" if cfg.attention_sinks else "attention_out_bias"
        raise ConfigError(f"{name} is not supported with kv_lora_rank (latent attention)")


def check_gemma(cfg: TransformerConfig) -> None:
    if cfg.hidden_act not in ACTS:
        raise ConfigError(f"hidden_act={cfg.hidden_act!r} must be one of {ACTS}")
    for name in (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "local_rope_theta",
    ):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise ConfigError(f"{name}={value!r} must be a positive number or None")
    cfg.full_attention_layers = tuple(cfg.full_attention_layers)
    bad = [i for i in cfg.full_attention_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise ConfigError(f"full_attention_layers {bad} are not blocks of {cfg.num_layers}")


def check_moe(cfg: TransformerConfig) -> None:
    if not isinstance(cfg.num_experts, int) or cfg.num_experts < 0:
        raise ConfigError(f"num_experts={cfg.num_experts!r} must be a non-negative integer")
    cfg.mlp_only_layers = tuple(cfg.mlp_only_layers)
    if not cfg.num_experts:
        return
    check_positive_int("num_experts_per_tok", cfg.num_experts_per_tok)
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}"
        )
    if cfg.moe_intermediate_size is None:
        cfg.moe_intermediate_size = cfg.intermediate_size
    check_positive_int("moe_intermediate_size", cfg.moe_intermediate_size)
    check_positive_int("decoder_sparse_step", cfg.decoder_sparse_step)
    if cfg.router_score not in ROUTER_SCORES:
        raise ConfigError(f"router_score={cfg.router_score!r} must be one of {ROUTER_SCORES}")
    if cfg.router_bias_update_rate and cfg.router_score != "sigmoid":
        raise ConfigError(
            f"router_bias_update_rate={cfg.router_bias_update_rate} needs router_score='sigmoid'"
        )
    if cfg.router_aux_loss_scope not in ("model", "layer"):
        raise ConfigError(
            f"router_aux_loss_scope={cfg.router_aux_loss_scope!r} must be 'model' or 'layer'"
        )
    for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        if not isinstance(getattr(cfg, name), int | float) or getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)!r} must be a number >= 0")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ConfigError(f"capacity_factor={cfg.capacity_factor!r} must be > 0 or None")
    check_expert_groups(cfg)


def check_expert_groups(cfg: TransformerConfig) -> None:
    check_positive_int("num_expert_groups", cfg.num_expert_groups)
    check_positive_int("topk_expert_groups", cfg.topk_expert_groups)
    groups, chosen = cfg.num_expert_groups, cfg.topk_expert_groups
    if cfg.num_experts % groups:
        raise ConfigError(f"num_expert_groups={groups} must divide num_experts={cfg.num_experts}")
    if chosen > groups:
        raise ConfigError(f"topk_expert_groups={chosen} exceeds num_expert_groups={groups}")
    if cfg.expert_group_score not in GROUP_SCORES:
        raise ConfigError(
            f"expert_group_score={cfg.expert_group_score!r} must be one of {GROUP_SCORES}"
        )
    top2 = cfg.expert_group_score == "top2_sum"
    if groups > 1 and top2 and cfg.router_score != "sigmoid":
        raise ConfigError(
            f"num_expert_groups={groups} with expert_group_score='top2_sum' needs "
            "router_score='sigmoid'"
        )
    if groups > 1 and top2 and cfg.num_experts // groups < 2:
        raise ConfigError(
            f"num_expert_groups={groups} leaves fewer than 2 experts per group "
            f"(num_experts={cfg.num_experts}); a group's score sums its best two"
        )
    if chosen * (cfg.num_experts // groups) < cfg.num_experts_per_tok:
        raise ConfigError(
            f"topk_expert_groups={chosen} groups of {cfg.num_experts // groups} experts "
            f"hold fewer than num_experts_per_tok={cfg.num_experts_per_tok}"
        )
    if not isinstance(cfg.routed_scaling_factor, int | float) or not (
        cfg.routed_scaling_factor > 0
    ):
        raise ConfigError(
            f"routed_scaling_factor={cfg.routed_scaling_factor!r} must be a positive number"
        )


def check_mla(cfg: TransformerConfig) -> None:
    mla = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if cfg.kv_lora_rank is None:
        others = [n for n in ("q_lora_rank", *mla) if getattr(cfg, n) is not None]
        if others or cfg.rope_interleaved:
            raise ConfigError(
                f"{(others or ['rope_interleaved'])[0]} needs kv_lora_rank (multi-head "
                "latent attention)"
            )
    else:
        for name in ("kv_lora_rank", *mla):
            check_positive_int(name, getattr(cfg, name))
        if cfg.q_lora_rank is not None:
            check_positive_int("q_lora_rank", cfg.q_lora_rank)
        if cfg.v_head_dim > cfg.head_dim:
            raise ConfigError(
                f"v_head_dim={cfg.v_head_dim} larger than qk_nope_head_dim + "
                f"qk_rope_head_dim={cfg.head_dim} is not supported"
            )
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
        if cfg.head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
            raise ConfigError(
                f"head_dim={cfg.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} with kv_lora_rank"
            )
        if cfg.num_kv_heads != cfg.num_heads:
            raise ConfigError(
                f"num_kv_heads={cfg.num_kv_heads} must equal num_heads={cfg.num_heads} "
                "with kv_lora_rank (latent attention expands keys for every head)"
            )
    if not isinstance(cfg.num_nextn_predict_layers, int) or cfg.num_nextn_predict_layers < 0:
        raise ConfigError(
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers!r} must be an integer >= 0"
        )
    if not isinstance(cfg.mtp_loss_scale, int | float) or cfg.mtp_loss_scale < 0:
        raise ConfigError(f"mtp_loss_scale={cfg.mtp_loss_scale!r} must be a number >= 0")
