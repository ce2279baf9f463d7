"""LoRA on the routed experts of a MoE block: one low-rank update per expert.

A `GroupedExperts` stacks its experts' projections as `w1`/`w3` (num_experts, hidden,
intermediate) and `w2` (num_experts, intermediate, hidden). `adapt_experts` gives each
targeted projection an `ExpertLoRA` in `experts.adapters[name]`, holding

- `lora_A` (num_experts, rank, in) and `lora_B` (num_experts, out, rank): expert e's
  factors have the shapes of a dense adapter's (`lora_A.weight` (rank, in),
  `lora_B.weight` (out, rank)), so tokens routed to expert e see
  x @ (W_e + scaling * B_e A_e) in our (in, out) layout.

Why per expert and not one A/B shared by all experts (or a shared A): the experts are
different functions of different tokens, and a fine-tune should be able to move each one
its own way; a shared adapter would add the same update to every expert, which is the
dense adapter the shared expert already offers. This is what peft's `target_parameters`
(`ParamWrapper` on a 3-D parameter: `lora_A` (E * r, in), `lora_B` (out, E * r)) and
MindSpeed-LLM's grouped-GEMM LoRA do. The cost is E times a dense adapter's parameters.

The update runs through the same grouped matmul as the base, over the same routed row
groups: h = grouped_matmul(dropout(x), A^T), delta = grouped_matmul(h, B^T) * scaling, so
no per-expert dense weight is formed in the forward. Dropout and scaling are the dense
adapter's (`LoRAConfig`: alpha / r, alpha / sqrt(r) with rslora). Both factors stack the
experts on dim 0, so expert parallel (applied after the `after_tp` hook that adds them)
shards them exactly as the base weights (`Shard(0)` over ep), and FSDP of the experts
shards them with the base. QLoRA does not quantise stacked expert weights:
`lora.quantize=nf4` with expert targets is refused (`check_quantize`). The peft export is
`peft_experts`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import dtensor
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.moe import GroupedExperts
from mindspeed_ops import grouped_matmul

EXPERT_PROJECTIONS = ("w1", "w3", "w2")
"""The stacked projections of `GroupedExperts` an adapter can target (our names)."""

__all__ = [
    "EXPERT_PROJECTIONS",
    "ExpertLoRA",
    "adapt_experts",
    "expert_adapters",
    "grouped_experts",
    "merge_expert_adapters",
]


class ExpertLoRA(nn.Module):
    """Per-expert LoRA of one stacked projection (num_experts, in, out)."""

    def __init__(
        self, a: Tensor, b: Tensor, *, scaling: float, dropout: float, impl: str, seed_name: str
    ):
        super().__init__()
        self.lora_A = nn.Parameter(a)  # (experts, rank, in)
        self.lora_B = nn.Parameter(b)  # (experts, out, rank)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_scaling = scaling
        self.lora_disabled = False
        self.impl = impl
        self.seed_name = seed_name

    def init_params(self, init: ParamInit) -> None:
        """A drawn whole from the generator of "experts name.projection" (peft's
        Kaiming-uniform per expert, bound 1 / sqrt(in)), B zero."""
        bound = 1 / math.sqrt(self.lora_A.shape[-1])
        init.uniform(self.lora_A, -bound, bound, name=self.seed_name)
        init.constant(self.lora_B, 0.0)

    def forward(self, x: Tensor, out: Tensor, counts: Tensor) -> Tensor:
        """`out` + scaling * B_e A_e x for the rows of each expert e (rows sorted by expert,
        `counts` per local expert); `out` alone inside `adapters_disabled`."""
        if self.lora_disabled:
            return out
        # Local shards under expert parallel; cast like the base weights (bf16 runs).
        a = dtensor.local(self.lora_A).to(x.dtype).transpose(1, 2)  # (experts, in, rank)
        b = dtensor.local(self.lora_B).to(x.dtype).transpose(1, 2)  # (experts, rank, out)
        h = grouped_matmul(self.lora_dropout(x), a, counts, impl=self.impl)  # (rows, rank)
        return out + grouped_matmul(h, b, counts, impl=self.impl) * self.lora_scaling

    def delta(self) -> Tensor:
        """scaling * (B_e A_e)^T for every expert: (experts, in, out) in fp32, the
        stacked weight's layout."""
        a, b = self.lora_A.float(), self.lora_B.float()
        return torch.bmm(a.transpose(1, 2), b.transpose(1, 2)) * self.lora_scaling


def grouped_experts(model: nn.Module) -> Iterator[tuple[str, GroupedExperts]]:
    """(name, module) of every `GroupedExperts` of `model`."""
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            yield name, module


def expert_adapters(model: nn.Module) -> Iterator[tuple[str, ExpertLoRA]]:
    """("layers.1.feed_forward.experts.w1", adapter) of every adapted expert projection."""
    for name, experts in grouped_experts(model):
        for proj, adapter in experts.adapters.items():
            yield f"{name}.{proj}", adapter


def check_quantize(quantize: str, names: list[str]) -> None:
    """Refuse NF4 when experts would be adapted.

    Raises:
        ConfigError: `quantize` is nf4 and `names` (adapted expert projections) is not empty.
    """
    if quantize != "none" and names:
        raise ConfigError(
            f"lora.quantize={quantize}: QLoRA on routed experts is not built (the stacked "
            f"expert weights, e.g. {names[0]}, are not quantised); leave the expert "
            "projections out of lora.targets (w1/w3/w2 = gate_proj/up_proj/down_proj = "
            "linear_fc1/linear_fc2) or set lora.quantize=none"
        )


def adapt_experts(
    targets: list[tuple[str, GroupedExperts, str]],
    *,
    rank: int,
    scaling: float,
    dropout: float,
    seed: int,
) -> None:
    """Add an `ExpertLoRA` for each (experts name, module, projection) of `targets`.

    A is drawn whole from the generator of `seed` and "experts name.projection", B is zero
    (`ExpertLoRA.init_params`; on the meta device, when the model is materialised). Call
    before expert parallel, which then shards both factors with the base.
    """
    for name, experts, proj in targets:
        weight = getattr(experts, proj)
        assert not isinstance(weight, DTensor), "expert LoRA goes before expert parallel"
        num_experts, in_features, out_features = weight.shape
        like = {"dtype": weight.dtype, "device": weight.device}
        a = torch.empty(num_experts, rank, in_features, **like)
        b = torch.empty(num_experts, out_features, rank, **like)
        adapter = ExpertLoRA(a, b, scaling=scaling, dropout=dropout, impl=experts.impl,
                             seed_name=f"{name}.{proj}")  # fmt: skip
        if not weight.is_meta:
            adapter.init_params(ParamInit(adapter, seed))
        experts.adapters[proj] = adapter


@torch.no_grad()
def merge_expert_adapters(model: nn.Module) -> None:
    """Fold every expert adapter into its stacked weight (W_e += scaling (B_e A_e)^T) and
    remove it; on a plain (not parallelised) model."""
    for _, experts in grouped_experts(model):
        for proj in list(experts.adapters):
            weight = getattr(experts, proj)
            weight.add_(experts.adapters[proj].delta().to(weight.dtype))
            del experts.adapters[proj]
