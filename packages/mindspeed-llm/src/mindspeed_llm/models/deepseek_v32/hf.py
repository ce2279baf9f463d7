"""DeepSeek-V3.2 in Hugging Face's spelling (`DeepseekV32ForCausalLM`, model_type
deepseek_v32): DeepSeek-V3's keys and weights (see `deepseek_v3.hf`) plus the indexer's
`index_topk`, `index_n_heads`, `index_head_dim` and its weights
`self_attn.indexer.{wq_b, wk, k_norm (a LayerNorm: weight and bias), weights_proj}`.
`layer_types` must be all "indexed_attention"; `mlp_layer_types` ("dense" first, then
"sparse") may replace `first_k_dense_replace`. The main attention's RoPE is always
interleaved (no `rope_interleave` key)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.hf_config import HFKeys, decoder_format
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.deepseek_v3 import hf as v3

_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    hf = dict(hf)
    types = hf.get("layer_types") or []
    if any(t != "indexed_attention" for t in types):
        raise ConfigError(f"layer_types {sorted(set(types))} are not supported (only 'indexed_attention')")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is not None:
        dense = mlp_types.count("dense")
        if mlp_types != ["dense"] * dense + ["sparse"] * (len(mlp_types) - dense):
            raise ConfigError("mlp_layer_types must be 'dense' blocks first, then 'sparse' ones")
        hf["first_k_dense_replace"] = dense
    if hf.get("q_lora_rank") is None:
        raise ConfigError("deepseek_v32 needs q_lora_rank (the indexer reads the low-rank query)")
    fields = v3.read_deepseek({**hf, "rope_interleave": True})
    return {
        **fields,
        "index_topk": hf.get("index_topk", 2048),
        "index_n_heads": hf.get("index_n_heads", 64),
        "index_head_dim": hf.get("index_head_dim", 128),
    }


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = v3.write_deepseek(config)
    out.pop("rope_interleave")
    return {
        **out,
        "index_topk": config.index_topk,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
    }


FORMAT = v3.latent_format(
    decoder_format("deepseek_v32", "DeepseekV32ForCausalLM", extra=HFKeys(read=_read, write=_write))
)


def _indexer_names(config: TransformerConfig) -> dict[str, str]:
    """Our indexer tensor -> Hugging Face's, every block (MTP blocks included)."""
    return {
        f"{ours}attention.indexer.{name}": f"{hf}self_attn.indexer.{name}"
        for ours, hf, _ in v3._layers(config)
        for name in _INDEXER
    }


class DeepseekV32Adapter:
    """DeepSeek-V3.2's `hf_adapter`: DeepSeek-V3's plus the indexer's tensors renamed."""

    @staticmethod
    def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        names = _indexer_names(config)
        missing = set(names) - set(state_dict)
        hf_adapter._check(missing=missing, unexpected=set(), side="our")
        rest = {k: v for k, v in state_dict.items() if k not in names}
        return {**v3.ADAPTER.to_hf(rest, config), **{h: state_dict[o] for o, h in names.items()}}

    @staticmethod
    def from_hf(hf_state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
        names = {h: o for o, h in _indexer_names(config).items()}
        missing = set(names) - set(hf_state_dict)
        hf_adapter._check(missing=missing, unexpected=set(), side="Hugging Face")
        # indexers of checkpoint MTP layers past num_nextn_predict_layers: skipped like them
        rest = {
            k: v for k, v in hf_state_dict.items()
            if k not in names and not (".self_attn.indexer." in k and _past_layers(k, config))
        }  # fmt: skip
        return {**v3.ADAPTER.from_hf(rest, config), **{o: hf_state_dict[h] for h, o in names.items()}}


def _past_layers(name: str, config: TransformerConfig) -> bool:
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and int(parts[2]) >= config.num_layers + config.num_nextn_predict_layers


ADAPTER = DeepseekV32Adapter()
