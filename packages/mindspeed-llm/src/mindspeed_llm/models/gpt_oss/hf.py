"""gpt-oss in Hugging Face's spelling (`GptOssForCausalLM`, model_type gpt_oss).

config.json: the shared decoder keys (RoPE as v4 `rope_theta` + `rope_scaling` or v5
`rope_parameters`, YaRN), `attention_bias` (q, k, v and o), `sliding_window` on the blocks
`layer_types` calls "sliding_attention" (default: the even ones), `num_local_experts` experts
of `intermediate_size`, top `num_experts_per_tok` (or `experts_per_token`),
`router_aux_loss_coef`, `swiglu_limit` and `swiglu_alpha` (v4 configs lack it: 1.702).
OpenAI's own checkpoints hold MXFP4 experts (`quantization_config`): refused, convert a
dequantized bf16 copy.

Weights: Llama's names, plus `self_attn.{q,k,v,o}_proj.bias`, `self_attn.sinks`,
`mlp.router.{weight,bias}` and the experts as stacked tensors: `mlp.experts.gate_up_proj`
(E, hidden, 2 * intermediate) with gate and up *interleaved* along the last dim (gate in the
even columns), `gate_up_proj_bias` (E, 2 * intermediate) likewise, `down_proj`
(E, intermediate, hidden) and `down_proj_bias` (E, hidden). Ours: w1 (gate) and w3 (up)
(E, hidden, intermediate), w2 (E, intermediate, hidden), biases b1, b3, b2: split and
interleaved back exactly (bit-identical both ways); an interleaved tensor is made once both
its halves are real (meta otherwise, for `hf_io`'s streaming conversion).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.config import TransformerConfig


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise ConfigError(
            f"quantization_config (quant_method={method!r}) is not supported: convert a "
            "dequantized (bf16) gpt-oss checkpoint"
        )
    if not hf.get("attention_bias", True):
        raise ConfigError("attention_bias=false is not supported for gpt_oss")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise ConfigError(
            f"layer_types must name {num_layers} layers 'sliding_attention' or "
            f"'full_attention', got {unknown or len(types)}"
        )
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    window = hf.get("sliding_window")
    if window is None and len(full) < num_layers:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is null")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ConfigError("the Hugging Face config has no 'num_local_experts'")
    return {
        "sliding_window": window if len(full) < num_layers else None,
        "full_attention_layers": full if len(full) < num_layers else (),
        "num_experts": experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok") or hf.get("experts_per_token", 4),
        "moe_intermediate_size": hf["intermediate_size"],
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.9),
        "swiglu_limit": hf.get("swiglu_limit", 7.0),
        "swiglu_alpha": hf.get("swiglu_alpha", 1.702),
    }


def _write(config: TransformerConfig) -> dict[str, Any]:
    full = set(config.full_attention_layers) if config.sliding_window else set(range(config.num_layers))
    return {
        "attention_bias": True,
        "layer_types": [
            "full_attention" if i in full else "sliding_attention" for i in range(config.num_layers)
        ],
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "experts_per_token": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "swiglu_limit": config.swiglu_limit,
        "swiglu_alpha": config.swiglu_alpha,
    }


FORMAT = decoder_format(
    "gpt_oss",
    "GptOssForCausalLM",
    flags={
        "qkv_bias": True,
        "attention_out_bias": True,
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
        "norm_topk_prob": True,
    },
    extra=HFKeys(read=_read, write=_write),
)

_RENAMED = {
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
_INTERLEAVED = {  # ours (gate, up) -> one interleaved Hugging Face tensor
    ("feed_forward.experts.w1", "feed_forward.experts.w3"): "mlp.experts.gate_up_proj",
    ("feed_forward.experts.b1", "feed_forward.experts.b3"): "mlp.experts.gate_up_proj_bias",
}
_DENSE_FFN = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


class GptOssAdapter:
    """gpt-oss's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    @staticmethod
    def name_map(config: TransformerConfig) -> dict[str, str]:
        """Our name -> Hugging Face name for every tensor that is only renamed."""
        names = hf_adapter.name_map(config)
        for i in range(config.num_layers):
            for ours in _DENSE_FFN:
                del names[f"layers.{i}.{ours}"]
            names.update({f"layers.{i}.{o}": f"model.layers.{i}.{h}" for o, h in _RENAMED.items()})
        return names

    @staticmethod
    def _pairs(config: TransformerConfig) -> dict[tuple[str, str], str]:
        return {
            (f"layers.{i}.{gate}", f"layers.{i}.{up}"): f"model.layers.{i}.{hf}"
            for i in range(config.num_layers)
            for (gate, up), hf in _INTERLEAVED.items()
        }

    def to_hf(self, state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        """Our state dict -> Hugging Face names; gate and up interleaved into gate_up_proj.

        Raises:
            CheckpointError: a tensor is missing or one has no Hugging Face name.
        """
        names, pairs = self.name_map(config), self._pairs(config)
        ours = set(names) | {k for pair in pairs for k in pair}
        extra = set(state_dict) - ours
        if config.tie_word_embeddings:
            extra.discard("output.weight")
        hf_adapter._check(missing=ours - set(state_dict), unexpected=extra, side="our")
        out = {hf: state_dict[o] for o, hf in names.items()}
        for (gate, up), hf in pairs.items():
            out[hf] = _interleave(state_dict[gate], state_dict[up])
        return out

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """A Hugging Face state dict -> our names; gate_up_proj split into w1 (even columns)
        and w3 (odd ones).

        Raises:
            CheckpointError: a tensor is missing or one is not part of this model.
        """
        names, pairs = self.name_map(config), self._pairs(config)
        hf_adapter.check_hf_keys(hf_state_dict, set(names.values()) | set(pairs.values()), config)
        out = {o: hf_state_dict[hf] for o, hf in names.items()}
        if config.tie_word_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        for (gate, up), hf in pairs.items():
            fused = hf_state_dict[hf]
            out[gate], out[up] = fused[..., 0::2].contiguous(), fused[..., 1::2].contiguous()
        return out


def _interleave(gate: Tensor, up: Tensor) -> Tensor:
    """(..., n) gate and up -> (..., 2n) with gate in the even columns; meta if either is
    (so `hf_io` can plan a conversion on meta tensors and make this once both are real)."""
    if gate.is_meta or up.is_meta:
        return torch.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=gate.dtype, device="meta")
    return torch.stack((gate, up), dim=-1).flatten(-2)


ADAPTER = GptOssAdapter()
