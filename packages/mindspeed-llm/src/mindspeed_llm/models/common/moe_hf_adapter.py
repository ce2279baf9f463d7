"""State-dict names and layouts to and from Hugging Face for the MoE families.

Attention, norms, embeddings and dense blocks are named as in `hf_adapter`. The experts
differ in layout: ours are stacked per layer, `experts.w1`/`w3` (num_experts, hidden,
intermediate) and `experts.w2` (num_experts, intermediate, hidden), the (groups, in, out)
layout of `grouped_matmul`; Hugging Face checkpoints (what `save_pretrained` writes, in
v4 and v5) hold one Linear weight (out, in) per expert:

- Qwen2-MoE / Qwen3-MoE (`MoEAdapter()`): `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`,
  router `mlp.gate.weight`, and for Qwen2-MoE `mlp.shared_expert.*` and `mlp.shared_expert_gate`;
- Mixtral (`MoEAdapter(expert_names=W1_W3_W2, block="block_sparse_moe")`):
  `model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight`, router
  `block_sparse_moe.gate.weight`.

`to_hf` writes those names. `from_hf` also reads the fused tensors transformers v5 keeps
in memory (`mlp.experts.gate_up_proj` (E, 2 * intermediate, hidden) and
`mlp.experts.down_proj` (E, hidden, intermediate), `mlp.gate.weight`), so a v5 model's
`state_dict()` loads too. Expert tensors must be whole (not DTensor shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.config import TransformerConfig

GATE_UP_DOWN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Our expert projection -> Hugging Face per-expert name, as Qwen-MoE spells them."""
W1_W3_W2 = {"w1": "w1", "w3": "w3", "w2": "w2"}
"""... and as Mixtral spells them."""
_SHARED = {
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_DENSE_FFN = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


@dataclass(frozen=True)
class MoEAdapter:
    """A MoE family's `hf_adapter`: `to_hf(state_dict, config)`, `from_hf(hf_state_dict, config)`."""

    expert_names: Mapping[str, str] = field(default_factory=lambda: dict(GATE_UP_DOWN))
    """Our expert projection (w1, w3, w2) -> the family's per-expert name."""
    block: str = "mlp"
    """The name of a MoE block in checkpoints (`model.layers.N.<block>`); transformers v5's
    fused in-memory tensors are always under `mlp`."""

    def name_map(self, config: TransformerConfig, *, fused: bool = False) -> dict[str, str]:
        """Our name -> Hugging Face name for every tensor that is only renamed (not experts)."""
        names = hf_adapter.name_map(config)
        for i in range(config.num_layers):
            if not config.is_moe_layer(i):
                continue
            for ours in _DENSE_FFN:
                del names[f"layers.{i}.{ours}"]
            prefix = self._prefix(i, fused)
            names[f"layers.{i}.feed_forward.router.weight"] = f"{prefix}.gate.weight"
            if config.shared_expert_intermediate_size:
                names.update(
                    {f"layers.{i}.{o}": f"model.layers.{i}.{h}" for o, h in _SHARED.items()}
                )
        return names

    def to_hf(
        self, state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """Our state dict -> Hugging Face checkpoint names, one (out, in) weight per expert.

        Raises:
            CheckpointError: a tensor is missing or one has no Hugging Face name.
        """
        names, experts = self.name_map(config), _expert_keys(config)
        extra = set(state_dict) - set(names) - set(experts)
        if config.tie_word_embeddings:
            extra.discard("output.weight")
        missing = (set(names) | set(experts)) - set(state_dict)
        hf_adapter._check(missing=missing, unexpected=extra, side="our")
        out = {hf: state_dict[ours] for ours, hf in names.items()}
        for key in experts:
            layer, proj = int(key.split(".")[1]), key.rsplit(".", 1)[1]
            prefix = self._prefix(layer)
            for e, weight in enumerate(state_dict[key].unbind(0)):  # (in, out) per expert
                out[f"{prefix}.experts.{e}.{self.expert_names[proj]}.weight"] = (
                    weight.t().contiguous()
                )
        return out

    def from_hf(
        self, hf_state_dict: Mapping[str, Tensor], config: TransformerConfig
    ) -> dict[str, Tensor]:
        """A Hugging Face state dict (checkpoint or v5 in-memory names) -> our names.

        Raises:
            CheckpointError: a tensor is missing or one is not part of this model.
        """
        fused = any(k.endswith(".experts.gate_up_proj") for k in hf_state_dict)
        to_ours = {hf: ours for ours, hf in self.name_map(config, fused=fused).items()}
        expert_sources = self._expert_sources(config, fused)
        wanted = set(to_ours) | {k for keys in expert_sources.values() for k in keys}
        hf_adapter.check_hf_keys(hf_state_dict, wanted, config)
        out = {ours: hf_state_dict[hf] for hf, ours in to_ours.items()}
        if config.tie_word_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        for ours, keys in expert_sources.items():
            out[ours] = _stack(ours, [hf_state_dict[k] for k in keys], fused)
        return out

    def expert_sources(
        self, config: TransformerConfig, present: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, list[str]]:
        """Our stacked expert tensor -> the per-expert (out, in) Hugging Face weights it
        stacks, transposed (`HFWeights` reads one expert's block at a time); empty for the
        fused tensors of transformers v5's in-memory names (`present` holds them)."""
        if any(k.endswith(".experts.gate_up_proj") for k in present):
            return {}
        return self._expert_sources(config, fused=False)

    def _prefix(self, layer: int, fused: bool = False) -> str:
        return f"model.layers.{layer}.{'mlp' if fused else self.block}"

    def _expert_sources(self, config: TransformerConfig, fused: bool) -> dict[str, list[str]]:
        """Our stacked expert tensor -> the Hugging Face tensors it is made of."""
        sources = {}
        for key in _expert_keys(config):
            layer, proj = int(key.split(".")[1]), key.rsplit(".", 1)[1]
            prefix = self._prefix(layer, fused)
            if fused:
                name = "down_proj" if proj == "w2" else "gate_up_proj"
                sources[key] = [f"{prefix}.experts.{name}"]
            else:
                sources[key] = [
                    f"{prefix}.experts.{e}.{self.expert_names[proj]}.weight"
                    for e in range(config.num_experts)
                ]
        return sources


def _expert_keys(config: TransformerConfig) -> list[str]:
    return [
        f"layers.{i}.feed_forward.experts.{w}"
        for i in range(config.num_layers)
        if config.is_moe_layer(i)
        for w in ("w1", "w2", "w3")
    ]


def _stack(ours: str, tensors: list[Tensor], fused: bool) -> Tensor:
    if not fused:  # one (out, in) Linear weight per expert
        return torch.stack([t.t() for t in tensors]).contiguous()
    (fused_weight,) = tensors  # (E, out, in), gate then up along `out` for gate_up_proj
    if ours.endswith("w2"):
        return fused_weight.transpose(1, 2).contiguous()
    gate, up = fused_weight.chunk(2, dim=1)
    return (gate if ours.endswith("w1") else up).transpose(1, 2).contiguous()
