"""Expert adapters in peft's format: `target_parameters` (`ParamWrapper`) on transformers
v5's fused 3-D experts, `mlp.experts.gate_up_proj` (E, 2 * inter, hidden) and
`mlp.experts.down_proj` (E, hidden, inter).

peft keeps one adapter per 3-D parameter: `lora_A.weight` (E * r, in), expert-major rows,
and `lora_B.weight` (out, r * E), whose columns are (rank, expert) with the expert fastest.
Ours are w1 (gate), w3 (up) and w2 (down), each with its own A. down_proj is w2's adapter
as it is. gate_up_proj gets a rank-2r adapter holding both exactly: A_e = [A1_e; A3_e],
B_e = [[B1_e, 0], [0, B3_e]] (zeros for a projection not targeted), with `rank_pattern`
2r and an `alpha_pattern` that keeps our scaling (2 alpha, or sqrt(2) alpha with rslora).
With both parameters targeted peft nests its wrappers, gate_up_proj's inside (its names
gain `base_layer.`), as `get_peft_model` builds them; `PeftModel.from_pretrained` of the
export gives the merged model's logits (tested).
"""

from __future__ import annotations

import math
import re

from torch import Tensor

from mindspeed_core.errors import CheckpointError

_KEY = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.adapters\.(w[123])\.(lora_[AB])$")
FUSED = ("gate_up_proj", "down_proj")
"""transformers v5's expert parameters, in the order peft nests their wrappers."""

__all__ = ["FUSED", "peft_expert_adapters"]


def peft_expert_adapters(
    tensors: dict[str, Tensor], *, rank: int, alpha: float, rslora: bool, prefix: str
) -> tuple[dict[str, Tensor], dict]:
    """Our expert adapter tensors -> (peft's tensors by saved name, the adapter_config
    entries: target_parameters, rank_pattern, alpha_pattern). `prefix` is what comes before
    `model.layers.N` in peft's names.

    Raises:
        CheckpointError: an expert adapter outside the decoder layers (a multi-token
            prediction module has no transformers counterpart).
    """
    layers: dict[int, dict[str, dict[str, Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise CheckpointError(f"{key}: no peft name for this expert adapter")
        layer, proj, factor = match.groups()
        layers.setdefault(int(layer), {}).setdefault(proj, {})[factor] = tensor
    projs = {p for by_proj in layers.values() for p in by_proj}
    wanted = {"gate_up_proj": bool(projs & {"w1", "w3"}), "down_proj": "w2" in projs}
    fused = [name for name in FUSED if wanted[name]]
    out = {}
    for layer, by_proj in layers.items():
        for name in fused:
            inner = "base_layer." if name == "gate_up_proj" and len(fused) == 2 else ""
            a, b = _down(by_proj) if name == "down_proj" else _gate_up(by_proj, rank)
            stem = f"{prefix}model.layers.{layer}.mlp.experts.{inner}"
            out[stem + "lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            # (E, out, r) -> (out, r * E), the expert fastest
            out[stem + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    config = {"target_parameters": [f"mlp.experts.{n}" for n in fused]}
    if "gate_up_proj" in fused:
        config["rank_pattern"] = {"gate_up_proj": 2 * rank}
        config["alpha_pattern"] = {"gate_up_proj": alpha * (math.sqrt(2) if rslora else 2)}
    return out, config


def _down(by_proj: dict[str, dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
    return by_proj["w2"]["lora_A"], by_proj["w2"]["lora_B"]


def _gate_up(by_proj: dict[str, dict[str, Tensor]], rank: int) -> tuple[Tensor, Tensor]:
    """(A (E, 2r, hidden), B (E, 2 inter, 2r)) holding w1's and w3's adapters side by side."""
    some = next(by_proj[p] for p in ("w1", "w3") if p in by_proj)
    num_experts, hidden = some["lora_A"].shape[0], some["lora_A"].shape[2]
    inter = some["lora_B"].shape[1]
    a = some["lora_A"].new_zeros(num_experts, 2 * rank, hidden)
    b = some["lora_B"].new_zeros(num_experts, 2 * inter, 2 * rank)
    for i, proj in enumerate(("w1", "w3")):
        if proj in by_proj:
            a[:, i * rank : (i + 1) * rank] = by_proj[proj]["lora_A"]
            b[:, i * inter : (i + 1) * inter, i * rank : (i + 1) * rank] = by_proj[proj]["lora_B"]
    return a, b
