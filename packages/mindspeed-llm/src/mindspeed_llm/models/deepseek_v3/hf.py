"""DeepSeek-V3 in Hugging Face's spelling (`DeepseekV3ForCausalLM`, model_type deepseek_v3).

config.json: the shared decoder keys (RoPE as v4 `rope_theta` + `rope_scaling` or v5
`rope_parameters`), the latent attention sizes (`q_lora_rank`, `kv_lora_rank`,
`qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`, default true),
the routed experts (`n_routed_experts`, `n_shared_experts` of `moe_intermediate_size`,
`n_group` / `topk_group`, `routed_scaling_factor`, sigmoid `scoring_func` with the
`noaux_tc` bias), `first_k_dense_replace` dense blocks of `intermediate_size`, and
`num_nextn_predict_layers` MTP modules. What we do not build is refused, naming the key.

Weights: `model.layers.N.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`; MoE blocks `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj` (or transformers
v5's fused in-memory `mlp.experts.gate_up_proj` / `down_proj`), `mlp.shared_experts.*`.
MTP module k is `model.layers.{num_hidden_layers + k}` as in DeepSeek's published
checkpoint: a decoder layer plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and
copies of the shared `embed_tokens` and `shared_head.head` (written from ours, dropped on
reading); MTP layers past `num_nextn_predict_layers` are skipped on reading. RoPE pairs need no permutation: `rope_interleaved` rotates DeepSeek's pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.common.moe_hf_adapter import GATE_UP_DOWN, _stack
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat

_SCORES = ("sigmoid",)
_TOPK_METHODS = (None, "noaux_tc")


def _check(hf: dict[str, Any]) -> None:
    """Refuse DeepSeek options we do not build, naming the key."""
    if hf.get("scoring_func", "sigmoid") not in _SCORES:
        raise ConfigError(
            f"scoring_func={hf['scoring_func']!r} is not supported (only {_SCORES[0]!r})"
        )
    if hf.get("topk_method") not in _TOPK_METHODS:
        raise ConfigError(f"topk_method={hf['topk_method']!r} is not supported (only 'noaux_tc')")
    check_weights_and_layers(hf)


def check_weights_and_layers(hf: dict[str, Any]) -> None:
    """Refuse fp8 (quantized) weights and MoE blocks other than every one after the dense
    first ones (DeepSeek-V2 and V3)."""
    if hf.get("quantization_config"):  # DeepSeek publishes block-wise fp8 weights
        method = hf["quantization_config"].get("quant_method")
        raise ConfigError(
            f"quantization_config (quant_method={method!r}) is not supported: dequantize the "
            "checkpoint to bf16 first (DeepSeek's fp8_cast_bf16.py)"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={hf['moe_layer_freq']!r} is not supported (only 1)")


def read_latent_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """Our fields for the keys DeepSeek-V2 and V3 share: latent attention sizes, routed and
    shared experts, dense first blocks (not the routing rule, RoPE pairing or MTP)."""
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    moe_width = hf.get("moe_intermediate_size", 2048)
    first_dense = hf.get("first_k_dense_replace") or 0
    return {
        "num_kv_heads": hf["num_attention_heads"],  # keys are expanded for every head
        "head_dim": nope + rope,
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": hf.get("v_head_dim", 128),
        "num_experts": hf.get("n_routed_experts") or hf.get("num_local_experts") or 256,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": moe_width * (hf.get("n_shared_experts") or 0),
        "shared_expert_gated": False,
        "routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
        "mlp_only_layers": tuple(range(min(first_dense, hf["num_hidden_layers"]))),
    }


def read_deepseek(hf: dict[str, Any]) -> dict[str, Any]:
    """Our fields for DeepSeek-V3's own config.json keys."""
    _check(hf)
    groups = hf.get("n_group") or 1
    return {
        **read_latent_moe(hf),
        "rope_interleaved": bool(hf.get("rope_interleave", True)),
        "router_score": "sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "num_expert_groups": groups,
        "topk_expert_groups": hf.get("topk_group") or groups,
        "num_nextn_predict_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)),
    }


def write_latent_moe(config: TransformerConfig) -> dict[str, Any]:
    """The config.json keys DeepSeek-V2 and V3 share (see `read_latent_moe`).

    Raises:
        ConfigError: dense blocks other than the first ones, or shared experts whose
            width is not a multiple of moe_intermediate_size.
    """
    first_dense = len(config.mlp_only_layers)
    if config.mlp_only_layers != tuple(range(first_dense)):
        raise ConfigError(
            f"mlp_only_layers={config.mlp_only_layers} must be the first blocks for {config.family}"
        )
    shared, width = config.shared_expert_intermediate_size, config.moe_intermediate_size
    if shared % width or config.shared_expert_gated:
        raise ConfigError(
            f"shared_expert_intermediate_size={shared} must be ungated and a multiple of "
            f"moe_intermediate_size={width} for {config.family}"
        )
    return {
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width,
        "routed_scaling_factor": config.routed_scaling_factor,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
    }


def write_deepseek(config: TransformerConfig) -> dict[str, Any]:
    """DeepSeek-V3's own config.json keys from our config (see `write_latent_moe`)."""
    return {
        **write_latent_moe(config),
        "rope_interleave": config.rope_interleaved,
        "n_group": config.num_expert_groups,
        "topk_group": config.topk_expert_groups,
        "norm_topk_prob": config.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
    }


_BASE = decoder_format(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    extra=HFKeys(read=read_deepseek, write=write_deepseek),
)


def latent_format(base: HFFormat) -> HFFormat:
    """`base` (a decoder format with latent-attention keys) writing no head_dim or
    sliding_window: transformers derives head_dim (= qk_rope_head_dim) itself; ours is the
    q/k width."""

    def write(config: TransformerConfig) -> dict[str, Any]:
        out = base.write(config)
        for key in ("head_dim", "sliding_window"):
            out.pop(key)
        return out

    return HFFormat(model_type=base.model_type, architecture=base.architecture, read=base.read,
                    write=write)  # fmt: skip


FORMAT = latent_format(_BASE)

# -- weights ------------------------------------------------------------------------------

_ATTENTION = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_FULL_Q = {"attention.wq.weight": "self_attn.q_proj.weight"}
_LOW_RANK_Q = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_MOE = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_MOE_NO_BIAS = {"feed_forward.router.weight": "mlp.gate.weight"}  # softmax routers (V2)
_SHARED = {
    "feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_COPIES = {  # HF name inside an MTP layer -> our shared tensor it copies
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}


def _layers(config: TransformerConfig):
    """(our prefix, HF prefix, layer id) of every decoder layer, MTP blocks included."""
    for i in range(config.num_layers):
        yield f"layers.{i}.", f"model.layers.{i}.", i
    for k in range(config.num_nextn_predict_layers):
        i = config.num_layers + k
        yield f"mtp.layers.{i}.block.", f"model.layers.{i}.", i


def latent_attention_names(config: TransformerConfig) -> dict[str, str]:
    """Our name -> Hugging Face name of a block's attention and its two norms (MLA)."""
    return {**_ATTENTION, **(_FULL_Q if config.q_lora_rank is None else _LOW_RANK_Q)}


AttentionNames = Callable[[TransformerConfig], dict[str, str]]


def name_map(
    config: TransformerConfig, attention: AttentionNames = latent_attention_names
) -> dict[str, str]:
    """Our name -> Hugging Face name for every tensor that is only renamed (not experts);
    `attention`: a block's attention and norm names (GLM-4.5 has ordinary attention)."""
    names = dict(hf_adapter._TOP)
    if config.tie_word_embeddings:
        del names["output.weight"]
    layer = attention(config)
    for ours, hf, i in _layers(config):
        own = dict(layer)
        if config.is_moe_layer(i):
            own.update(_MOE if config.router_score == "sigmoid" else _MOE_NO_BIAS)
            own.update(_SHARED if config.shared_expert_intermediate_size else {})
        else:
            own.update(_DENSE)
        names.update({ours + o: hf + h for o, h in own.items()})
    for k in range(config.num_nextn_predict_layers):
        i = config.num_layers + k
        names.update({f"mtp.layers.{i}.{o}": f"model.layers.{i}.{h}" for o, h in _MTP.items()})
    return names


def _expert_sources(
    config: TransformerConfig, present: Collection[str] = ()
) -> dict[str, list[str]]:
    """Our stacked expert tensor -> the Hugging Face tensors it is made of: per-expert
    checkpoint names, or transformers v5's fused ones for a layer `present` has them for."""
    sources = {}
    for ours, hf, i in _layers(config):
        if not config.is_moe_layer(i):
            continue
        fused = f"{hf}mlp.experts.gate_up_proj" in present
        for w, name in GATE_UP_DOWN.items():
            key = f"{ours}feed_forward.experts.{w}"
            if fused:
                sources[key] = [f"{hf}mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}"]
            else:
                sources[key] = [
                    f"{hf}mlp.experts.{e}.{name}.weight" for e in range(config.num_experts)
                ]
    return sources


def _mtp_copies(config: TransformerConfig) -> dict[str, str]:
    """HF copy name in each MTP layer -> our shared tensor."""
    out = {}
    for k in range(config.num_nextn_predict_layers):
        hf = f"model.layers.{config.num_layers + k}."
        out.update({hf + h: o for h, o in _MTP_COPIES.items()})
    return out


def _unused_mtp(present: set[str], config: TransformerConfig) -> set[str]:
    """Tensors of the checkpoint's MTP layers past the config's num_nextn_predict_layers
    (a layer is MTP when it has `eh_proj`): skipped, as transformers skips them all."""
    first = config.num_layers + config.num_nextn_predict_layers
    layers = {
        name.split(".")[2]
        for name in present
        if name.endswith(".eh_proj.weight") and int(name.split(".")[2]) >= first
    }
    return {
        name
        for name in present
        if name.startswith("model.layers.") and name.split(".")[2] in layers
    }


@dataclass(frozen=True)
class DeepseekV3Adapter:
    """DeepSeek-V3's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    attention: AttentionNames = latent_attention_names
    """A block's attention and norm names (GLM-4.5 reuses this adapter with its own)."""

    def to_hf(
        self, state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """Our state dict -> DeepSeek's checkpoint names (one (out, in) weight per expert).

        Raises:
            CheckpointError: a tensor is missing or one has no Hugging Face name.
        """
        names, experts = name_map(config, self.attention), _expert_sources(config)
        extra = set(state_dict) - set(names) - set(experts)
        if config.tie_word_embeddings:
            extra.discard("output.weight")
        missing = (set(names) | set(experts)) - set(state_dict)
        hf_adapter._check(missing=missing, unexpected=extra, side="our")
        out = {hf: state_dict[ours] for ours, hf in names.items()}
        for ours, hf_names in experts.items():
            for hf, weight in zip(hf_names, state_dict[ours].unbind(0), strict=True):
                out[hf] = weight.t().contiguous()  # (in, out) per expert -> (out, in)
        for hf, ours in _mtp_copies(config).items():
            out[hf] = state_dict[ours]
        return out

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """A Hugging Face state dict (checkpoint or v5 in-memory names) -> our names.

        Raises:
            CheckpointError: a tensor is missing or one is not part of this model.
        """
        to_ours = {hf: ours for ours, hf in name_map(config, self.attention).items()}
        sources = _expert_sources(config, set(hf_state_dict))
        wanted = set(to_ours) | {k for keys in sources.values() for k in keys}
        present = {k for k in hf_state_dict if not k.endswith(hf_adapter._IGNORED_SUFFIXES)}
        allowed = set(_mtp_copies(config)) | _unused_mtp(present, config)
        hf_adapter.check_hf_keys(hf_state_dict, wanted, config, allowed=allowed)
        out = {ours: hf_state_dict[hf] for hf, ours in to_ours.items()}
        if config.tie_word_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        for ours, keys in sources.items():
            fused = keys[0].endswith("gate_up_proj") or keys[0].endswith("experts.down_proj")
            out[ours] = _stack(ours, [hf_state_dict[k] for k in keys], fused)
        return out


    def expert_sources(
        self, config: TransformerConfig, present: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, list[str]]:
        """Our stacked expert tensor -> the per-expert (out, in) weights it stacks,
        transposed (see `MoEAdapter.expert_sources`); layers stored fused are left out."""
        sources = _expert_sources(config, present)
        return {k: v for k, v in sources.items() if v[0].endswith(".weight")}  # not fused


ADAPTER = DeepseekV3Adapter()
