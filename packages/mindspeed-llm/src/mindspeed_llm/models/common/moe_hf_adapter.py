"""State-dict names and layouts to and from Hugging Face for the MoE families.

Attention, norms, embeddings and dense blocks are named as in `hf_adapter`. The experts
differ in layout: ours are stacked per layer, `experts.w1`/`w3` (num_experts, hidden,
intermediate) and `experts.w2` (num_experts, intermediate, hidden), the (groups, in, out)
layout of `grouped_matmul`; Hugging Face checkpoints (what `save_pretrained` writes, in
v4 and v5) hold one Linear weight (out, in) per expert:

- Mixtral: `model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight`, router
  `block_sparse_moe.gate.weight`;
- Qwen2-MoE / Qwen3-MoE: `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, router
  `mlp.gate.weight`, and for Qwen2-MoE `mlp.shared_expert.*` and `mlp.shared_expert_gate`.

`to_hf` writes those names. `from_hf` also reads the fused tensors transformers v5 keeps
in memory (`mlp.experts.gate_up_proj` (E, 2 * intermediate, hidden) and
`mlp.experts.down_proj` (E, hidden, intermediate), `mlp.gate.weight`), so a v5 model's
`state_dict()` loads too. Expert tensors must be whole (not DTensor shards).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.config import TransformerConfig

# Our projection -> Hugging Face per-expert name, by family.
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "qwen": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
_SHARED = {
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_DENSE_FFN = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def _style(config: TransformerConfig) -> str:
    return "mixtral" if config.family == "mixtral" else "qwen"


def _block_prefix(config: TransformerConfig, layer: int, fused: bool = False) -> str:
    moe = "block_sparse_moe" if config.family == "mixtral" and not fused else "mlp"
    return f"model.layers.{layer}.{moe}"


def name_map(config: TransformerConfig, *, fused: bool = False) -> dict[str, str]:
    """Our name -> Hugging Face name for every tensor that is only renamed (not experts)."""
    names = hf_adapter.name_map(config)
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        for ours in _DENSE_FFN:
            del names[f"layers.{i}.{ours}"]
        prefix = _block_prefix(config, i, fused)
        names[f"layers.{i}.feed_forward.router.weight"] = f"{prefix}.gate.weight"
        if config.shared_expert_intermediate_size:
            names.update({f"layers.{i}.{o}": f"model.layers.{i}.{h}" for o, h in _SHARED.items()})
    return names


def _expert_keys(config: TransformerConfig) -> list[str]:
    return [
        f"layers.{i}.feed_forward.experts.{w}"
        for i in range(config.num_layers)
        if config.is_moe_layer(i)
        for w in ("w1", "w2", "w3")
    ]


def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face checkpoint names, one (out, in) weight per expert.

    Raises:
        CheckpointError: a tensor is missing or one has no Hugging Face name.
    """
    names, experts = name_map(config), _expert_keys(config)
    extra = set(state_dict) - set(names) - set(experts)
    if config.tie_word_embeddings:
        extra.discard("output.weight")
    missing = (set(names) | set(experts)) - set(state_dict)
    hf_adapter._check(missing=missing, unexpected=extra, side="our")
    out = {hf: state_dict[ours] for ours, hf in names.items()}
    hf_names = _EXPERT_NAMES[_style(config)]
    for key in experts:
        layer, proj = int(key.split(".")[1]), key.rsplit(".", 1)[1]
        prefix = _block_prefix(config, layer)
        for e, weight in enumerate(state_dict[key].unbind(0)):  # (in, out) per expert
            out[f"{prefix}.experts.{e}.{hf_names[proj]}.weight"] = weight.t().contiguous()
    return out


def from_hf(hf_state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """A Hugging Face state dict (checkpoint or v5 in-memory names) -> our names.

    Raises:
        CheckpointError: a tensor is missing or one is not part of this model.
    """
    fused = any(k.endswith(".experts.gate_up_proj") for k in hf_state_dict)
    to_ours = {hf: ours for ours, hf in name_map(config, fused=fused).items()}
    expert_sources = _expert_sources(config, fused)
    wanted = set(to_ours) | {k for keys in expert_sources.values() for k in keys}
    present = {k for k in hf_state_dict if not k.endswith(hf_adapter._IGNORED_SUFFIXES)}
    extra = present - wanted
    if config.tie_word_embeddings:
        extra.discard("lm_head.weight")
    hf_adapter._check(missing=wanted - present, unexpected=extra, side="Hugging Face")
    out = {ours: hf_state_dict[hf] for hf, ours in to_ours.items()}
    if config.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    for ours, keys in expert_sources.items():
        out[ours] = _stack(ours, [hf_state_dict[k] for k in keys], fused)
    return out


def _expert_sources(config: TransformerConfig, fused: bool) -> dict[str, list[str]]:
    """Our stacked expert tensor -> the Hugging Face tensors it is made of."""
    hf_names = _EXPERT_NAMES[_style(config)]
    sources = {}
    for key in _expert_keys(config):
        layer, proj = int(key.split(".")[1]), key.rsplit(".", 1)[1]
        prefix = _block_prefix(config, layer, fused)
        if fused:
            sources[key] = [f"{prefix}.experts.{'down_proj' if proj == 'w2' else 'gate_up_proj'}"]
        else:
            sources[key] = [
                f"{prefix}.experts.{e}.{hf_names[proj]}.weight" for e in range(config.num_experts)
            ]
    return sources


def _stack(ours: str, tensors: list[Tensor], fused: bool) -> Tensor:
    if not fused:  # one (out, in) Linear weight per expert
        return torch.stack([t.t() for t in tensors]).contiguous()
    (fused_weight,) = tensors  # (E, out, in), gate then up along `out` for gate_up_proj
    if ours.endswith("w2"):
        return fused_weight.transpose(1, 2).contiguous()
    gate, up = fused_weight.chunk(2, dim=1)
    return (gate if ours.endswith("w1") else up).transpose(1, 2).contiguous()
