"""Phi-3 in Hugging Face's spelling: the shared decoder keys, a Mistral-style window, and
fused `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj` ([gate; up] rows).

The adapter renames through the dense `hf_adapter` and splits (from_hf, views) or
concatenates (to_hf) the fused tensors; concatenating a meta part gives a meta result, so
`hf_io`'s planning on meta tensors works, and a fused tensor is made once all its parts
are real.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mindspeed_core.errors import CheckpointError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import MISTRAL_WINDOW, decoder_format
from mindspeed_llm.models.config import TransformerConfig

FORMAT = decoder_format("phi3", "Phi3ForCausalLM", window=MISTRAL_WINDOW)


def _fused(config: TransformerConfig, qkv: bool = True) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused Hugging Face name -> its parts (separate HF name, rows), per layer; `qkv`:
    q/k/v fused too (Phi-3), else only gate/up (GLM-4)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    out = {}
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if qkv:
            out[attn + "qkv_proj.weight"] = (
                (attn + "q_proj.weight", q),
                (attn + "k_proj.weight", kv),
                (attn + "v_proj.weight", kv),
            )
        out[mlp + "gate_up_proj.weight"] = (
            (mlp + "gate_proj.weight", config.intermediate_size),
            (mlp + "up_proj.weight", config.intermediate_size),
        )
    return out


def _cat(parts: list[Tensor]) -> Tensor:
    if any(p.is_meta for p in parts):
        rows = sum(p.shape[0] for p in parts)
        return torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


def fuse(
    hf_state_dict: Mapping[str, Tensor], config: TransformerConfig, qkv: bool = True
) -> dict[str, Tensor]:
    """Separate Hugging Face tensors -> the fused ones (see `_fused`)."""
    out = dict(hf_state_dict)
    for fused, parts in _fused(config, qkv).items():
        out[fused] = _cat([out.pop(name) for name, _ in parts])
    return out


def split(
    hf_state_dict: Mapping[str, Tensor], config: TransformerConfig, qkv: bool = True
) -> dict[str, Tensor]:
    """Fused Hugging Face tensors -> separate ones (views).

    Raises:
        CheckpointError: a fused tensor is missing or has the wrong number of rows.
    """
    out = dict(hf_state_dict)
    for fused, parts in _fused(config, qkv).items():
        if fused not in out:
            raise CheckpointError(
                f"Hugging Face state dict does not fit the model config: missing {fused}"
            )
        tensor = out.pop(fused)
        rows = [n for _, n in parts]
        if tensor.shape[0] != sum(rows):
            raise CheckpointError(
                f"{fused} has {tensor.shape[0]} rows, the config gives {sum(rows)}"
            )
        out.update(zip([name for name, _ in parts], tensor.split(rows), strict=True))
    return out


class Phi3Adapter:
    """Phi-3's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    @staticmethod
    def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        return fuse(hf_adapter.to_hf(state_dict, config), config)

    @staticmethod
    def from_hf(
        hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        return hf_adapter.from_hf(split(hf_state_dict, config), config)


ADAPTER = Phi3Adapter()
