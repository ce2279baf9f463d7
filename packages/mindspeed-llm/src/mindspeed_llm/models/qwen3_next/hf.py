"""Qwen3-Next in Hugging Face's spelling (`Qwen3NextForCausalLM`, model_type qwen3_next).

config.json: the shared decoder keys, `layer_types` ("linear_attention" / "full_attention";
v4 configs may give `full_attention_interval` instead, default 4), `partial_rotary_factor`
(top level or in v5's `rope_parameters`, default 0.25), the `linear_*` sizes, Qwen-MoE's
expert keys with a gated shared expert. The multi-token-prediction weights (`mtp.*`) are
skipped on reading, as transformers does; `mtp_num_hidden_layers` is not trained.

Weights: full-attention blocks `self_attn.{q,k,v,o}_proj` with q_proj rows [q, gate] per
head, `self_attn.{q,k}_norm`; linear blocks `linear_attn.{in_proj_qkvz, in_proj_ba,
conv1d, dt_bias, A_log, norm, out_proj}` (kept in the checkpoints' per-key-head grouping,
so only names change, but for the convolution: Hugging Face's channels [all q, all k,
all v] become ours grouped per key head, each head's q, k, v); MoE blocks as Qwen2-MoE. Hugging Face rotates the first
`rotary_dim` channels of a head in rotate-half pairs (i, i + rotary_dim / 2); ours pairs
(i, i + head_dim / 2), so the q rows (not the gate's), k rows and q/k norm weights are
permuted per head, which leaves every attention score unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format, qwen_experts
from mindspeed_llm.models.common.moe_hf_adapter import MoEAdapter
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat

_LINEAR = ("in_proj_qkvz", "in_proj_ba", "conv1d", "dt_bias", "A_log", "norm", "out_proj")


def _read_layers(hf: dict[str, Any]) -> dict[str, Any]:
    num_layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
    ]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise ConfigError(
            f"layer_types must name {num_layers} layers 'linear_attention' or 'full_attention', "
            f"got {unknown or len(types)}"
        )
    return {
        "linear_attention_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        **{key: hf[key] for key in ("linear_num_key_heads", "linear_num_value_heads",
                                   "linear_key_head_dim", "linear_value_head_dim")},  # fmt: skip
        "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
    }


def _write_layers(config: TransformerConfig) -> dict[str, Any]:
    linear = set(config.linear_attention_layers)
    return {
        "layer_types": [
            "linear_attention" if i in linear else "full_attention" for i in range(config.num_layers)
        ],
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "partial_rotary_factor": (config.rotary_dim or config.head_dim) / config.head_dim,
    }


def hybrid_format(
    model_type: str, architecture: str, *, experts: bool, every_block_moe: bool = False
) -> HFFormat:
    """The config.json format of Qwen3-Next and its Qwen3.5 successors (`experts`: routed
    experts with a gated shared expert, Qwen-MoE's keys; `every_block_moe`: Qwen3.5-MoE's,
    which has no sparse-step keys and always renormalises the top-k weights). A multimodal
    Qwen3.5 config (its language model in `text_config`) reads as that language model."""
    base = decoder_format(
        model_type,
        architecture,
        flags={"qk_norm": True, "norm_unit_offset": True, "attention_output_gate": True},
        experts=qwen_experts(shared_expert=False) if experts else None,
        extra=HFKeys(read=_read_layers, write=_write_layers),
    )

    def read(hf: dict[str, Any]) -> dict[str, Any]:
        hf = dict(hf.get("text_config") or hf)
        rope = dict(hf.get("rope_parameters") or {})
        factor = rope.pop("partial_rotary_factor", None) or hf.pop("partial_rotary_factor", 0.25)
        hf.pop("partial_rotary_factor", None)
        # Qwen3.5's multimodal RoPE: text tokens have equal t/h/w positions, plain RoPE
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        if rope:
            hf["rope_parameters"] = rope
        if every_block_moe and "intermediate_size" not in hf:  # no dense block to size
            hf["intermediate_size"] = hf.get("moe_intermediate_size")
        fields = base.read(hf)
        head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_heads"]
        rotary_dim = int(head_dim * factor)
        if every_block_moe:
            fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
        return {**fields, "rotary_dim": None if rotary_dim == head_dim else rotary_dim}

    return HFFormat(model_type=model_type, architecture=architecture, read=read, write=base.write)


FORMAT = hybrid_format("qwen3_next", "Qwen3NextForCausalLM", experts=True)


def pairing(head_dim: int, rotary_dim: int) -> Tensor:
    """Channel index of one head: ours[c] = Hugging Face's[index[c]], for a rotate-half
    RoPE over the first rotary_dim channels (Hugging Face) and over pairs (c, c + head_dim/2)
    (ours); the pass-through channels are paired the same way."""
    half, rot, index = head_dim // 2, rotary_dim // 2, [0] * head_dim
    for j in range(rot):
        index[j], index[half + j] = j, rot + j
    rest = (head_dim - rotary_dim) // 2
    for m in range(rest):
        index[rot + m], index[half + rot + m] = rotary_dim + m, rotary_dim + rest + m
    return torch.tensor(index)


def _permute_rows(tensor: Tensor, index: Tensor, block: int) -> Tensor:
    """Permute the first len(index) rows of each `block`-row block of `tensor`."""
    blocks = tensor.shape[0] // block
    rows = torch.arange(tensor.shape[0]).view(blocks, block).clone()
    rows[:, : len(index)] = rows[:, index]
    return tensor[rows.flatten()]


@dataclass(frozen=True)
class Qwen3NextAdapter(MoEAdapter):
    """Qwen3-Next's `hf_adapter` (see the module docstring); `split_projections`: Qwen3.5's
    spelling of the linear blocks' inputs, `in_proj_qkv` ([all q, all k, all v] rows),
    `in_proj_z`, `in_proj_b`, `in_proj_a`, regrouped per key head into ours (bit-exact)."""

    split_projections: bool = False

    def name_map(self, config: TransformerConfig, *, fused: bool = False) -> dict[str, str]:
        names = super().name_map(config, fused=fused)
        for i in config.linear_attention_layers:
            for key in [k for k in names if k.startswith(f"layers.{i}.attention.")]:
                del names[key]
            prefix = f"model.layers.{i}.linear_attn"
            if not self.split_projections:
                names.update({
                    f"layers.{i}.attention.in_proj_qkvz.weight": f"{prefix}.in_proj_qkvz.weight",
                    f"layers.{i}.attention.in_proj_ba.weight": f"{prefix}.in_proj_ba.weight",
                })  # fmt: skip
            names.update({
                f"layers.{i}.attention.conv_weight": f"{prefix}.conv1d.weight",
                f"layers.{i}.attention.dt_bias": f"{prefix}.dt_bias",
                f"layers.{i}.attention.A_log": f"{prefix}.A_log",
                f"layers.{i}.attention.norm.weight": f"{prefix}.norm.weight",
                f"layers.{i}.attention.out_proj.weight": f"{prefix}.out_proj.weight",
            })  # fmt: skip
        return names

    def to_hf(self, state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        fused = {}
        if self.split_projections:  # ours -> Qwen3.5's four projections, per linear block
            state_dict = dict(state_dict)
            for i in config.linear_attention_layers:
                ours = f"layers.{i}.attention."
                qkvz = state_dict.pop(ours + "in_proj_qkvz.weight")
                ba = state_dict.pop(ours + "in_proj_ba.weight")
                fused.update(_split_projections(qkvz, ba, config, f"model.layers.{i}.linear_attn."))
        out = super().to_hf(state_dict, config)
        out = _conv_channels(_rotary_rows(out, config, inverse=True), config, inverse=True)
        return {**out, **fused}

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        # a multimodal Qwen3.5 checkpoint: its language model, without the vision tower
        kept = {
            _language_model_name(k): v for k, v in hf_state_dict.items()
            if not k.startswith(("mtp.", "model.visual."))
        }  # fmt: skip
        kept = _conv_channels(_rotary_rows(kept, config, inverse=False), config, inverse=False)
        grouped = {}
        if self.split_projections:
            for i in config.linear_attention_layers:
                hf = f"model.layers.{i}.linear_attn."
                parts = [f"{hf}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
                missing = [p for p in parts if p not in kept]
                if missing:
                    hf_adapter._check(missing=set(missing), unexpected=set(), side="Hugging Face")
                tensors = [kept.pop(p) for p in parts]
                ours = f"layers.{i}.attention."
                grouped[ours + "in_proj_qkvz.weight"], grouped[ours + "in_proj_ba.weight"] = (
                    _group_projections(*tensors, config)
                )
        return {**super().from_hf(kept, config), **grouped}


def _language_model_name(name: str) -> str:
    """`model.language_model.X` (a multimodal checkpoint's) -> `model.X`."""
    prefix = "model.language_model."
    return "model." + name[len(prefix) :] if name.startswith(prefix) else name


def _projection_index(config: TransformerConfig) -> tuple[Tensor, Tensor]:
    """Row indices: our in_proj_qkvz rows from cat(in_proj_qkv, in_proj_z) rows, and our
    in_proj_ba rows from cat(in_proj_b, in_proj_a) rows (Qwen3.5's), grouped per key head."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    nv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    r = nv // nk
    qkv_rows = 2 * nk * dk + nv * dv
    qkvz, ba = [], []
    for h in range(nk):
        qkvz += range(h * dk, (h + 1) * dk)  # q
        qkvz += range(nk * dk + h * dk, nk * dk + (h + 1) * dk)  # k
        qkvz += range(2 * nk * dk + h * r * dv, 2 * nk * dk + (h + 1) * r * dv)  # v
        qkvz += range(qkv_rows + h * r * dv, qkv_rows + (h + 1) * r * dv)  # z
        ba += range(h * r, (h + 1) * r)
        ba += range(nv + h * r, nv + (h + 1) * r)
    return torch.tensor(qkvz), torch.tensor(ba)


def _group_projections(qkv, z, b, a, config) -> tuple[Tensor, Tensor]:
    qkvz_index, ba_index = _projection_index(config)
    return torch.cat([qkv, z])[qkvz_index], torch.cat([b, a])[ba_index]


def _split_projections(qkvz: Tensor, ba: Tensor, config, prefix: str) -> dict[str, Tensor]:
    qkvz_index, ba_index = _projection_index(config)
    rows = qkvz[torch.argsort(qkvz_index)]
    ba_rows = ba[torch.argsort(ba_index)]
    qkv_rows = qkvz.shape[0] - config.linear_num_value_heads * config.linear_value_head_dim
    nv = config.linear_num_value_heads
    return {
        prefix + "in_proj_qkv.weight": rows[:qkv_rows],
        prefix + "in_proj_z.weight": rows[qkv_rows:],
        prefix + "in_proj_b.weight": ba_rows[:nv],
        prefix + "in_proj_a.weight": ba_rows[nv:],
    }


def conv_grouping(config: TransformerConfig) -> Tensor:
    """Channel index of the convolution: ours[c] = Hugging Face's[index[c]], ours grouped
    per key head (its q, k, then its value heads' channels)."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    v_per = config.linear_num_value_heads // nk * config.linear_value_head_dim
    index = []
    for h in range(nk):
        index += range(h * dk, (h + 1) * dk)
        index += range(nk * dk + h * dk, nk * dk + (h + 1) * dk)
        index += range(2 * nk * dk + h * v_per, 2 * nk * dk + (h + 1) * v_per)
    return torch.tensor(index)


def _conv_channels(sd: Mapping[str, Tensor], config: TransformerConfig, *, inverse: bool):
    """The linear blocks' conv1d weights from Hugging Face's channel order to ours (or back)."""
    index = conv_grouping(config)
    index = torch.argsort(index) if inverse else index
    out = dict(sd)
    for i in config.linear_attention_layers:
        key = f"model.layers.{i}.linear_attn.conv1d.weight"
        if key in out:
            out[key] = out[key][index]
    return out


def _rotary_rows(sd: Mapping[str, Tensor], config: TransformerConfig, *, inverse: bool):
    """q (not gate) rows, k rows and q/k norm weights of the full-attention blocks from
    Hugging Face's channel order to ours (or back); a copy of `sd`."""
    d = config.head_dim
    index = pairing(d, config.rotary_dim or d)
    index = torch.argsort(index) if inverse else index
    out = dict(sd)
    for i in range(config.num_layers):
        if i in config.linear_attention_layers:
            continue
        prefix = f"model.layers.{i}.self_attn"
        for name, block in (("q_proj.weight", 2 * d), ("k_proj.weight", d),
                            ("q_norm.weight", d), ("k_norm.weight", d)):  # fmt: skip
            key = f"{prefix}.{name}"
            if key in out:
                out[key] = _permute_rows(out[key], index, block)
    return out


ADAPTER = Qwen3NextAdapter()
