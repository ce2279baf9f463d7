"""The Hugging Face `config.json` of our decoder, and the pieces in which families differ.

`decoder_format(model_type, architecture, flags=..., window=..., experts=...)` builds a
family's `HFFormat` (see each family's `hf.py`):

- the keys every Llama-like config shares: sizes, heads, RoPE in transformers v4
  (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5 (`rope_parameters`, `dtype`)
  spellings, norm epsilon, tied embeddings, init std;
- `flags`: our fields the family always has (Qwen2's q/k/v biases, Qwen3's qk-norm);
- `window`: how it spells a sliding window (`MISTRAL_WINDOW`, `QWEN_WINDOW`; None: the
  family has none);
- `experts`: how it spells routed experts (`MIXTRAL_EXPERTS`, `qwen_experts(...)`).

Reading refuses what our modules do not build instead of ignoring it; writing gives
v4 keys, which transformers v5 also reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.config import ROPE_SCALING, TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat


@dataclass(frozen=True)
class HFKeys:
    """One piece of a format: our fields from config.json, and its keys from our config."""

    read: Callable[[dict[str, Any]], dict[str, Any]]
    write: Callable[[TransformerConfig], dict[str, Any]]


def decoder_format(
    model_type: str,
    architecture: str,
    *,
    flags: Mapping[str, Any] | None = None,
    window: HFKeys | None = None,
    experts: HFKeys | None = None,
    extra: HFKeys | None = None,
    hidden_act: str = "silu",
) -> HFFormat:
    """The `HFFormat` of a family of our decoder (see the module docstring); `extra`: the
    family's own keys (Gemma 2's), `hidden_act`: the Hugging Face activation it allows."""
    flags = dict(flags or {})
    parts = [p for p in (window, experts, extra) if p is not None]

    def read(hf: dict[str, Any]) -> dict[str, Any]:
        _check_features(hf, qkv_bias=bool(flags.get("qkv_bias")), hidden_act=hidden_act)
        fields = {**_read_common(hf), **flags}
        for part in parts:
            fields.update(part.read(hf))
        return fields

    def write(config: TransformerConfig) -> dict[str, Any]:
        out = _write_common(config)
        for part in parts:
            out.update(part.write(config))
        if config.dtype is not None:
            out["torch_dtype"] = config.dtype
        return out

    return HFFormat(model_type=model_type, architecture=architecture, read=read, write=write)


def _required(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ConfigError(f"the Hugging Face config has no {key!r}")
    return hf[key]


def _read_common(hf: dict[str, Any]) -> dict[str, Any]:
    fields = {
        key: _required(hf, hf_key)
        for key, hf_key in (
            ("vocab_size", "vocab_size"),
            ("hidden_size", "hidden_size"),
            ("intermediate_size", "intermediate_size"),
            ("num_layers", "num_hidden_layers"),
            ("num_heads", "num_attention_heads"),
        )
    }
    theta, scaling = _read_rope(hf)
    return {
        **fields,
        "num_kv_heads": hf.get("num_key_value_heads") or fields["num_heads"],
        "head_dim": hf.get("head_dim"),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": hf.get("initializer_range", 0.02),
        "dtype": _read_dtype(hf),
    }


def _write_common(config: TransformerConfig) -> dict[str, Any]:
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": _write_rope_scaling(config.rope_scaling),
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.init_std,
        "attention_bias": False,
        "sliding_window": config.sliding_window,
    }


def _check_features(hf: dict[str, Any], *, qkv_bias: bool, hidden_act: str = "silu") -> None:
    """Refuse options our modules do not build, instead of silently ignoring them."""
    for key in ("hidden_act", "hidden_activation"):
        act = hf.get(key) or hidden_act
        if act != hidden_act:
            raise ConfigError(f"{key}={act!r} is not supported (only {hidden_act!r})")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    # A family with built-in q/k/v biases (Qwen2) has them regardless; elsewhere
    # attention_bias also biases o_proj, which we do not build.
    if not qkv_bias and hf.get("attention_bias"):
        raise ConfigError(
            f"attention_bias=true is not supported for model_type {hf['model_type']!r}"
        )


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, our rope_scaling) from v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING:
        raise ConfigError(
            f"rope type {kind!r} is not supported; choose one of {sorted(ROPE_SCALING)}"
        )
    required, optional = ROPE_SCALING[kind]
    if "original_max_position_embeddings" in required:
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if kind == "yarn" and params.get("factor") is None:
        # transformers: the ratio of the context lengths when no factor is given.
        params["factor"] = (
            hf["max_position_embeddings"] / params["original_max_position_embeddings"]
        )
    kept = {k: v for k, v in params.items() if k in required or k in optional}
    return theta, {"type": kind, **kept}


def _write_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    out = {k: v for k, v in scaling.items() if v is not None}
    out["rope_type"] = out["type"]
    return out


def _read_dtype(hf: dict[str, Any]) -> str | None:
    value = hf.get("dtype") or hf.get("torch_dtype")
    if value is None:
        return None
    return str(value).removeprefix("torch.")


# -- sliding windows ----------------------------------------------------------------------


def _read_qwen_window(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen: layers from max_window_layers on slide (or as `layer_types` says), only with
    use_sliding_window; we build all-or-nothing."""
    window = hf.get("sliding_window")
    if window is None or not hf.get("use_sliding_window", False):
        return {"sliding_window": None}
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", num_layers) else "full_attention"
        for i in range(num_layers)
    ]
    if all(t == "sliding_attention" for t in types):
        return {"sliding_window": window}
    if all(t == "full_attention" for t in types):
        return {"sliding_window": None}
    raise ConfigError(
        "a sliding window on some layers only (max_window_layers / layer_types) is not supported"
    )


MISTRAL_WINDOW = HFKeys(
    read=lambda hf: {"sliding_window": hf.get("sliding_window")},
    write=lambda config: {},  # `sliding_window` is one of the common keys
)
"""Mistral / Mixtral: `sliding_window` on every layer, or null."""
QWEN_WINDOW = HFKeys(
    read=_read_qwen_window,
    write=lambda config: {
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": 0,
    },
)
"""Qwen2/3 (and their MoE): `sliding_window` applies only with `use_sliding_window`, from
layer `max_window_layers` on."""


# -- routed experts -----------------------------------------------------------------------


def _read_mixtral_experts(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("router_jitter_noise"):
        raise ConfigError("router_jitter_noise > 0 is not supported")
    return {
        "num_experts": hf.get("num_local_experts", 8),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
        "moe_intermediate_size": hf["intermediate_size"],
        "norm_topk_prob": True,
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


MIXTRAL_EXPERTS = HFKeys(
    read=_read_mixtral_experts,
    write=lambda config: {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "router_aux_loss_coef": config.router_aux_loss_coef,
    },
)
"""Mixtral: `num_local_experts` experts as wide as `intermediate_size`, top-k renormalised."""


def _read_qwen_experts(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        # transformers v5 writes Qwen3-MoE's count as num_local_experts
        "num_experts": hf.get("num_experts") or _required(hf, "num_local_experts"),
        "num_experts_per_tok": _required(hf, "num_experts_per_tok"),
        "moe_intermediate_size": _required(hf, "moe_intermediate_size"),
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }


def qwen_experts(*, shared_expert: bool) -> HFKeys:
    """Qwen2-MoE (`shared_expert=True`: a gated shared expert, and `qkv_bias` spelled
    out) and Qwen3-MoE: `num_experts` of `moe_intermediate_size`, sparse-step layers."""

    def write(config: TransformerConfig) -> dict[str, Any]:
        out = {
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "decoder_sparse_step": config.decoder_sparse_step,
            "mlp_only_layers": list(config.mlp_only_layers),
        }
        if shared_expert:
            out["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
            out["qkv_bias"] = True
        return out

    return HFKeys(read=_read_qwen_experts, write=write)
