"""Megatron-LM's saved args <-> the Hugging Face config of the model they describe.

`hf_config` (reading) turns the args into a Hugging Face config.json, refusing by name each
architecture feature we do not convert; `megatron_args` (writing) gives the args
Megatron-LM would have saved for one of our dense models, after `check_config` refused what
its dense GPT layout cannot hold. Both use Megatron-LM's argument names.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_tools.convert.megatron.files import arg as _arg


def hf_config(args: Mapping[str, Any], file: Path) -> dict[str, Any]:
    """The Hugging Face config.json of the model Megatron-LM's args describe.

    Raises:
        ConfigError: an architecture feature we do not convert (the arg is named).
    """

    def refuse(name: str, why: str) -> ConfigError:
        return ConfigError(f"{file}: args.{name}={args.get(name)!r}: {why}")

    checks = (
        ("normalization", lambda v: v == "RMSNorm", "only RMSNorm models are converted"),
        ("swiglu", bool, "only SwiGLU MLPs (Llama/Qwen/Mistral) are converted"),
        ("position_embedding_type", lambda v: v == "rope", "only RoPE models are converted"),
    )
    for name, ok, why in checks:
        if not ok(args.get(name)):
            raise refuse(name, why)
    for name, why in (
        ("add_bias_linear", "linear-layer biases have no Hugging Face Llama/Qwen equivalent"),
        ("multi_latent_attention", "DeepSeek's multi-latent attention is not converted yet"),
        ("rotary_interleaved", "interleaved RoPE is not converted"),
        ("use_rope_scaling", "Llama-3.1 RoPE scaling is not converted yet"),
        ("decoder_first_pipeline_num_layers", "uneven pipeline stages are not converted"),
        ("decoder_last_pipeline_num_layers", "uneven pipeline stages are not converted"),
        ("account_for_embedding_in_pipeline_split", "uneven pipeline stages are not converted"),
        ("account_for_loss_in_pipeline_split", "uneven pipeline stages are not converted"),
        ("pipeline_model_parallel_layout", "uneven pipeline stages are not converted"),
    ):
        if args.get(name):
            raise refuse(name, why)
    if _arg(args, "rotary_percent", file, 1.0) != 1.0:
        raise refuse("rotary_percent", "partial RoPE is not converted")
    heads = _arg(args, "num_attention_heads", file)
    hidden = _arg(args, "hidden_size", file)
    groups = _arg(args, "num_query_groups", file) if args.get("group_query_attention") else heads
    qkv_bias, qk_norm = bool(args.get("add_qkv_bias")), bool(args.get("qk_layernorm"))
    model_type = "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"
    experts = _moe_config(args, file, qk_norm, qkv_bias, refuse) if args.get("num_experts") else {}
    model_type = experts.pop("model_type", model_type)
    architecture = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mixtral": "Mixtral",
        "qwen3_moe": "Qwen3Moe",
    }[model_type]
    config = {
        "architectures": [architecture + "ForCausalLM"],
        "model_type": model_type,
        "vocab_size": _arg(args, "padded_vocab_size", file),
        "hidden_size": hidden,
        "intermediate_size": _arg(args, "ffn_hidden_size", file),
        "num_hidden_layers": _arg(args, "num_layers", file),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _arg(args, "kv_channels", file, hidden // heads),
        "max_position_embeddings": _arg(args, "max_position_embeddings", file),
        "rms_norm_eps": _arg(args, "norm_epsilon", file, 1e-5),
        "rope_theta": float(_arg(args, "rotary_base", file, 10000)),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        **experts,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    config["torch_dtype"] = dtype
    return config


def _moe_config(
    args: Mapping[str, Any], file: Path, qk_norm: bool, qkv_bias: bool, refuse: Any
) -> dict[str, Any]:
    """The experts' part of the Hugging Face config: Qwen3-MoE when the attention has
    qk-norm, Mixtral otherwise. Megatron's default routing (top-k of the router's logits,
    softmax over those k) is Mixtral's and Qwen3-MoE's `norm_topk_prob`; with
    `moe_router_pre_softmax` (softmax over all experts, then top-k) it is Qwen3-MoE's
    un-normalised routing."""
    for name, why in (
        ("moe_shared_expert_intermediate_size", "shared experts are not converted yet"),
        ("moe_router_enable_expert_bias", "aux-loss-free expert bias is not converted yet"),
        ("moe_router_num_groups", "group-limited routing is not converted yet"),
        ("moe_router_topk_scaling_factor", "scaled routing weights are not converted yet"),
    ):
        if args.get(name):
            raise refuse(name, why)
    if args.get("moe_router_score_function", "softmax") != "softmax":
        raise refuse("moe_router_score_function", "only softmax routing is converted")
    freq = args.get("moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, list) and set(freq) == {1})):
        raise refuse("moe_layer_freq", "only models whose every layer is MoE are converted")
    if qkv_bias:
        raise refuse("add_qkv_bias", "MoE with q/k/v biases (Qwen2-MoE) is not converted yet")
    num = _arg(args, "num_experts", file)
    topk = _arg(args, "moe_router_topk", file, 2)
    width = _arg(args, "moe_ffn_hidden_size", file, None) or _arg(args, "ffn_hidden_size", file)
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    if qk_norm:
        return {
            "model_type": "qwen3_moe",
            "num_experts": num,
            "num_experts_per_tok": topk,
            "moe_intermediate_size": width,
            "norm_topk_prob": not pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
        }
    if pre_softmax:
        raise refuse(
            "moe_router_pre_softmax", "Mixtral renormalises its top-k (qk-norm models only)"
        )
    return {
        "model_type": "mixtral",
        "num_local_experts": num,
        "num_experts_per_tok": topk,
        "intermediate_size": width,
        "sliding_window": None,
        "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
    }


# -- writing: our config -> the args Megatron-LM saves ----------------------------------------

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def check_config(config: TransformerConfig, source: Path, tp: int, pp: int) -> None:
    """Refuse what Megatron's dense GPT layout or the layout cannot hold (named)."""
    groups = config.num_kv_heads or config.num_heads
    problems = {
        "model_type": config.family not in _FAMILIES,
        "sliding_window": config.sliding_window is not None,
        "rope_scaling": config.rope_scaling is not None,
        f"num_hidden_layers={config.num_layers} (not divisible by --pp {pp})": (
            config.num_layers % pp != 0
        ),
        f"num_key_value_heads={groups} (not divisible by --tp {tp})": groups % tp != 0,
        f"vocab_size={config.vocab_size} (not divisible by --tp {tp})": config.vocab_size % tp != 0,
        f"intermediate_size={config.intermediate_size} (not divisible by --tp {tp})": (
            config.intermediate_size % tp != 0
        ),
    }
    for what, bad in problems.items():
        if bad:
            raise ConfigError(
                f"{source / hf_io.CONFIG_FILE}: {what}: not written as a dense Megatron GPT "
                f"checkpoint (families: {', '.join(_FAMILIES)}, no sliding window or RoPE scaling)"
            )


def megatron_args(
    config: TransformerConfig, tp: int, pp: int, dtype: torch.dtype
) -> argparse.Namespace:
    """The args Megatron-LM would have saved for this model (its argument names)."""
    heads = config.num_heads
    groups = config.num_kv_heads or heads
    return argparse.Namespace(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=config.head_dim or config.hidden_size // heads,
        max_position_embeddings=config.max_position_embeddings,
        padded_vocab_size=config.vocab_size,
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=1,
        normalization="RMSNorm",
        norm_epsilon=config.norm_eps,
        swiglu=True,
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=int(config.rope_theta),
        rotary_percent=1.0,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        add_bias_linear=False,
        add_qkv_bias=config.qkv_bias,
        qk_layernorm=config.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
    )
