"""InternLM2 / InternLM2.5 in its published (remote-code) spelling, model_type `internlm2`.

config.json: Llama's keys (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
`intermediate_size`, `rms_norm_eps`, `rope_theta`, `rope_scaling`), with the q/k/v and
output biases spelled `bias` (must be false here) and no `head_dim` (always hidden_size /
num_attention_heads). `rope_scaling` of type dynamic (InternLM2.5) is refused by name.

Weights: our own names under `model.` (`model.tok_embeddings`, `model.layers.N.attention_norm`,
`attention.wo`, `ffn_norm`, `feed_forward.w1/w3/w2`, `model.norm`), `output.weight` at the
top level, and q, k, v fused in `attention.wqkv` grouped by key/value head: for each kv
head, the rows of its num_heads / num_kv_heads query heads, then its key head, then its
value head. RoPE is rotate-half as ours, so no row is permuted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat

_BASE = decoder_format("internlm2", "InternLM2ForCausalLM")


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    hf = dict(hf)
    if hf.pop("bias", False):
        raise ConfigError("internlm2 with bias=true is not supported")
    return _BASE.read(hf)


def _write(config: TransformerConfig) -> dict[str, Any]:
    if config.head_dim * config.num_heads != config.hidden_size:
        raise ConfigError(
            f"head_dim={config.head_dim} must be hidden_size / num_heads for internlm2 "
            "(its config.json has no head_dim)"
        )
    out = _BASE.write(config)
    for key in ("head_dim", "attention_bias", "sliding_window"):
        out.pop(key)
    out["bias"] = False
    return out


FORMAT = HFFormat(model_type="internlm2", architecture=_BASE.architecture, read=_read, write=_write)

# -- weights ------------------------------------------------------------------------------

_TOP = {
    "tok_embeddings.weight": "model.tok_embeddings.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "output.weight",
}
_LAYER = (
    "attention_norm.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w3.weight",
    "feed_forward.w2.weight",
)
_QKV = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")


def name_map(config: TransformerConfig) -> dict[str, str]:
    """Our name -> InternLM2's, for every tensor only renamed (all but q, k, v)."""
    names = dict(_TOP)
    if config.tie_word_embeddings:
        del names["output.weight"]
    for i in range(config.num_layers):
        names.update({f"layers.{i}.{n}": f"model.layers.{i}.{n}" for n in _LAYER})
    return names


def _fused(config: TransformerConfig) -> dict[str, tuple[str, str, str]]:
    """InternLM2's wqkv name -> our q, k, v names, per layer."""
    return {
        f"model.layers.{i}.attention.wqkv.weight": tuple(f"layers.{i}.{n}" for n in _QKV)
        for i in range(config.num_layers)
    }


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, config: TransformerConfig) -> Tensor:
    """q (heads * d, hidden), k and v (kv_heads * d, hidden) -> wqkv in the grouped layout
    (a meta result when any part is meta, so planning on meta tensors works)."""
    groups, d = config.num_kv_heads, config.head_dim
    per_group = config.num_heads // groups
    hidden = q.shape[-1]
    if any(t.is_meta for t in (q, k, v)):
        rows = (config.num_heads + 2 * groups) * d
        return torch.empty((rows, hidden), dtype=q.dtype, device="meta")
    parts = (
        q.reshape(groups, per_group * d, hidden),
        k.reshape(groups, d, hidden),
        v.reshape(groups, d, hidden),
    )
    return torch.cat(parts, dim=1).reshape(-1, hidden)  # (groups * (per_group + 2) * d, hidden)


def split_qkv(name: str, wqkv: Tensor, config: TransformerConfig) -> tuple[Tensor, Tensor, Tensor]:
    """wqkv in the grouped layout -> (q, k, v) as our separate projections.

    Raises:
        CheckpointError: wqkv's rows are not (num_heads + 2 * num_kv_heads) * head_dim.
    """
    groups, d = config.num_kv_heads, config.head_dim
    per_group = config.num_heads // groups
    rows = (config.num_heads + 2 * groups) * d
    if wqkv.dim() != 2 or wqkv.shape[0] != rows:
        raise CheckpointError(f"{name} has shape {tuple(wqkv.shape)}, the config gives {rows} rows")
    hidden = wqkv.shape[1]
    grouped = wqkv.reshape(groups, per_group + 2, d, hidden)
    q = grouped[:, :per_group].reshape(config.num_heads * d, hidden)
    k = grouped[:, per_group].reshape(groups * d, hidden)
    v = grouped[:, per_group + 1].reshape(groups * d, hidden)
    return q, k, v


class InternLM2Adapter:
    """InternLM2's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    @staticmethod
    def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        """Our state dict -> InternLM2's names, q/k/v fused (a tied output left out).

        Raises:
            CheckpointError: a tensor is missing or one has no InternLM2 name.
        """
        names, fused = name_map(config), _fused(config)
        ours = set(names) | {n for parts in fused.values() for n in parts}
        extra = set(state_dict) - ours
        if config.tie_word_embeddings:
            extra.discard("output.weight")
        hf_adapter._check(missing=ours - set(state_dict), unexpected=extra, side="our")
        out = {hf: state_dict[name] for name, hf in names.items()}
        for hf, parts in fused.items():
            out[hf] = fuse_qkv(*(state_dict[p] for p in parts), config)
        return out

    @staticmethod
    def from_hf(
        hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """InternLM2's state dict -> our names, wqkv split into q, k, v.

        Raises:
            CheckpointError: a tensor is missing, one is not part of this model, or a
                wqkv has the wrong number of rows.
        """
        to_ours, fused = {hf: n for n, hf in name_map(config).items()}, _fused(config)
        wanted = set(to_ours) | set(fused)
        hf_adapter.check_hf_keys(hf_state_dict, wanted, config, tied_copy="output.weight")
        out = {ours: hf_state_dict[hf] for hf, ours in to_ours.items()}
        if config.tie_word_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        for hf, parts in fused.items():
            out.update(zip(parts, split_qkv(hf, hf_state_dict[hf], config), strict=True))
        return out


ADAPTER = InternLM2Adapter()
