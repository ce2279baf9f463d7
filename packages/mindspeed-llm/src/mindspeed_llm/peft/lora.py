"""LoRA: low-rank adapters on the linear layers of a (tensor-parallel) decoder.

`lora_transform(config)` is an `after_tp` model hook (see `build_model`): it runs after
tensor parallel has made the planned weights DTensors and before FSDP, freezes the base and
gives every targeted `nn.Linear` two children, `lora_A` (rank x in) and `lora_B`
(out x rank), plus a forward hook adding `scaling * B(A(dropout(x)))` to its output.
Module names stay the base's (`layers.0.attention.wq.weight`; the adapter is
`layers.0.attention.wq.lora_A.weight`), so the TP plan, FSDP and checkpoint names are
untouched; the adapter names are peft's, under our module paths.

The adapter follows its base's tensor-parallel placement, read from the base weight: a
column-parallel base (weight Shard(0)) gets A replicated and B sharded on the output dim; a
row-parallel base (Shard(1)) gets A sharded on the input dim and B replicated, and the
rank-sized partial sums are all-reduced before B. Every rank draws the whole adapter from
a generator of the run's seed and the module's name, and keeps its share, so every layout
(tp shards, pipeline stages) starts from one process's adapter. Initialisation is peft's:
A Kaiming-uniform, B 0.

The routed experts of a MoE block are not linear layers but stacked weights; a target
naming w1/w3/w2 (gate_proj/up_proj/down_proj, linear_fc1/linear_fc2) adapts them too, one
A/B per expert (`mindspeed_llm.peft.experts`). The router is never adapted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.peft.experts import (
    EXPERT_PROJECTIONS,
    adapt_experts,
    check_quantize,
    expert_adapters,
    grouped_experts,
    merge_expert_adapters,
)
from mindspeed_llm.peft.targets import HEAD_NAMES, HF_NAMES, MEGATRON_NAMES

__all__ = [
    "HF_NAMES",
    "LoRAConfig",
    "adapted_modules",
    "adapters_disabled",
    "apply_lora",
    "lora_trainer_options",
    "lora_transform",
    "merge_lora",
    "merged_state",
]

_OURS = {hf: ours for ours, hf in {**HF_NAMES, **HEAD_NAMES}.items()}


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = 0
    """Adapter rank r; 0: no LoRA (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / r) B A, or (alpha / sqrt(r)) B A with rslora."""
    dropout: float = 0.0
    """Dropout on the adapter's input (masks are drawn per rank under tensor parallel)."""
    targets: list[str] = field(default_factory=lambda: list(HF_NAMES.values()))
    """Linear layers to adapt, by name: q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj (Hugging Face's), wq wk wv wo w1 w3 w2 (ours) or linear_fc1 (= w1 w3)
    linear_fc2 (= w2) (MindSpeed-LLM's). The feed-forward names also adapt a MoE block's
    routed experts (one adapter per expert) and its shared expert. lm_head (ours: output),
    the output projection, only when named (one process or FSDP: no tensor or pipeline
    parallel, no tied or padded vocabulary)."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski, 2023), as peft's use_rslora."""
    quantize: str = "none"
    """"nf4": QLoRA, the frozen base's decoder linear weights stored in NF4 (block 64, fp32
    absmax) and dequantised per forward (`mindspeed_llm.peft.qlora`); "none": as loaded."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = [t for t in self.targets if not _expand(t)]
        if unknown:
            known = " ".join([*HF_NAMES.values(), *HF_NAMES, *MEGATRON_NAMES, *HEAD_NAMES.values()])
            raise ConfigError(f"lora.targets: unknown layer {unknown[0]!r} (known: {known})")
        if self.rank and not self.targets:
            raise ConfigError("lora.targets is empty: name at least one linear layer")
        if self.quantize not in ("none", "nf4"):
            raise ConfigError(f"lora.quantize={self.quantize!r}: choose none or nf4")
        if self.quantize != "none" and not self.rank:
            raise ConfigError(f"lora.quantize={self.quantize} needs adapters: set lora.rank > 0")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def our_targets(self) -> set[str]:
        """`targets` in our names."""
        return {name for t in self.targets for name in _expand(t)}


def _expand(target: str) -> tuple[str, ...]:
    """Our layer names a target stands for (empty: an unknown name)."""
    if target in MEGATRON_NAMES:
        return MEGATRON_NAMES[target]
    ours = _OURS.get(target, target)
    return (ours,) if ours in HF_NAMES or ours in HEAD_NAMES else ()


def lora_transform(config: LoRAConfig):
    """The `after_tp` hook of `build_model` / `Trainer` that applies `config`."""

    def after_tp(model: nn.Module, dims=None) -> set[nn.Parameter]:
        if dims is not None and set(HEAD_NAMES) & config.our_targets() and dims.pp > 1:
            raise ConfigError(f"lora.targets={config.targets}: lm_head (the output layer) is "
                              f"not adapted under parallel.pp={dims.pp} yet")  # fmt: skip
        apply_lora(model, config)
        if config.quantize != "nf4":
            return set()
        from mindspeed_llm.peft.qlora import pending_weights, quantize_base

        quantize_base(model)
        return pending_weights(model)  # FSDP leaves them whole

    return after_tp


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Freeze `model` and add adapters to its targeted linear layers and routed experts'
    projections, in place.

    Returns the names of the adapted modules (an expert projection as
    "layers.1.feed_forward.experts.w1").

    Raises:
        ConfigError: a target matches no linear layer or expert projection of `model`;
            `quantize=nf4` with routed experts targeted.
    """
    wanted = config.our_targets()
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in wanted
    ]
    experts = [
        (name, module, proj)
        for name, module in grouped_experts(model)
        for proj in EXPERT_PROJECTIONS
        if proj in wanted
    ]
    seen = {name.rsplit(".", 1)[-1] for name, _ in found} | {p for _, _, p in experts}
    missing = [t for t in config.targets if not seen.intersection(_expand(t))]
    if missing:
        raise ConfigError(
            f"lora.targets: {missing[0]!r} matches no linear layer of the model "
            f"(its linear layers: {' '.join(sorted(_linear_names(model)))})"
        )
    _check_head(model, [module for name, module in found if name.rsplit(".", 1)[-1] in HEAD_NAMES])
    expert_names = [f"{name}.{proj}" for name, _, proj in experts]
    check_quantize(config.quantize, expert_names)
    model.requires_grad_(False)
    seed = torch.initial_seed()  # the run's seed (`build_model` set it on every rank)
    for name, module in found:
        _adapt(module, config, name, seed)
    adapt_experts(experts, rank=config.rank, scaling=config.scaling, dropout=config.dropout,
                  seed=seed)  # fmt: skip
    return [name for name, _ in found] + expert_names


def _check_head(model: nn.Module, heads: list[nn.Linear]) -> None:
    """Refuse an output projection an adapter cannot be merged into or saved for alone: one
    sharing its weight with the embedding (tied: the merge would change the inputs too), split
    over the vocabulary (tensor parallel) or with padding rows (its B would not be the Hugging
    Face head's shape)."""
    config = getattr(model, "config", None)
    embedding = getattr(model, "tok_embeddings", None)
    for head in heads:
        why = None
        if embedding is not None and head.weight is embedding.weight:
            why = "its weight is the embedding's (tie_word_embeddings)"
        elif isinstance(head.weight, DTensor):
            why = "it is split over the vocabulary (parallel.tp > 1)"
        elif config is not None and head.out_features != config.vocab_size:
            why = f"it has {head.out_features} rows for a vocabulary of {config.vocab_size}"
        if why:
            raise ConfigError(f"lora.targets: lm_head (the output layer) cannot take an adapter "
                              f"here: {why}")  # fmt: skip


def _linear_names(model: nn.Module) -> set[str]:
    """Leaf names of the linear layers, and the routed experts' projections."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if next(grouped_experts(model), None) is not None:
        names |= set(EXPERT_PROJECTIONS)
    return names


def _adapt(linear: nn.Linear, config: LoRAConfig, name: str, seed: int) -> None:
    weight = linear.weight
    like = {"dtype": weight.dtype, "device": weight.device}
    a = torch.empty(config.rank, linear.in_features, **like)
    b = torch.empty(linear.out_features, config.rank, **like)
    if isinstance(weight, DTensor):
        a_place, b_place = _placements(weight)
        a = distribute_tensor(a, weight.device_mesh, a_place)
        b = distribute_tensor(b, weight.device_mesh, b_place)
    linear.lora_A = LoRAFactor(a, seed_name=name)
    linear.lora_B = LoRAFactor(b)
    if not weight.is_meta:  # else when the model is materialised (`Transformer.init_weights`)
        for factor in (linear.lora_A, linear.lora_B):
            factor.init_params(ParamInit(factor, seed))
    linear.lora_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
    linear.lora_scaling = config.scaling
    linear.lora_handle = linear.register_forward_hook(_add_lora)


class LoRAFactor(nn.Module):
    """A bias-free linear holding `weight` (peft's `lora_A`/`lora_B` names)."""

    def __init__(self, weight: torch.Tensor, *, seed_name: str | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.seed_name = seed_name
        """A: the adapted module's name, whose generator draws it whole (a rank keeps its
        shard, so every layout starts from one process's adapter); None: B, zero."""

    def init_params(self, init: ParamInit) -> None:
        if self.seed_name is None:
            init.constant(self.weight, 0.0)
            return
        # peft's default: kaiming_uniform_(a=sqrt(5)), its bound computed as torch does
        std = math.sqrt(2.0 / (1 + 5)) / math.sqrt(self.weight.shape[1])
        bound = math.sqrt(3.0) * std
        init.uniform(self.weight, -bound, bound, name=self.seed_name)


def _placements(weight: DTensor):
    """(A's, B's) placements for a base weight [out, in] placed as `weight`."""
    (place,) = weight.placements
    if place == Shard(0):  # column parallel: outputs split
        return [Replicate()], [Shard(0)]
    if place == Shard(1):  # row parallel: inputs split
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def _add_lora(linear: nn.Linear, args, output):
    """Forward hook: output + scaling * B(A(dropout(x))), in the base output's layout;
    the base output alone inside `adapters_disabled`."""
    if getattr(linear, "lora_disabled", False):
        return output
    x = linear.lora_dropout(args[0])
    h = F.linear(x, linear.lora_A.weight)
    if isinstance(h, DTensor) and any(p.is_partial() for p in h.placements):
        h = h.redistribute(placements=[Replicate()])  # row parallel: sum the rank-r parts
    delta = F.linear(h, linear.lora_B.weight) * linear.lora_scaling
    if isinstance(delta, DTensor):
        delta = _like(delta, output)
    return output + delta


def _like(delta: DTensor, output):
    """`delta` in `output`'s layout: its placements (a DTensor output), else the local
    shard of the same shape (Shard(-1) column parallel, Replicate or, under sequence
    parallel, Shard(1) row parallel)."""
    if isinstance(output, DTensor):
        return delta.redistribute(placements=output.placements)
    local = delta.to_local()
    if local.shape == output.shape:
        return local
    local = delta.redistribute(placements=[Shard(1)]).to_local()
    if local.shape != output.shape:
        raise RuntimeError(f"LoRA output {tuple(local.shape)} does not fit {tuple(output.shape)}")
    return local


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every adapter of `model` is bypassed: the base model's outputs (a LoRA run's
    reference, with no second copy of the weights)."""
    linears = [linear for _, linear in adapted_modules(model)]
    linears += [adapter for _, adapter in expert_adapters(model)]
    for linear in linears:
        linear.lora_disabled = True
    try:
        yield
    finally:
        for linear in linears:
            linear.lora_disabled = False


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(name, linear) of every layer carrying an adapter."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "lora_A"):
            yield name, module


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += scaling B A; each routed expert's
    own) and remove it; in place on a plain (not parallelised) model."""
    for _, linear in list(adapted_modules(model)):
        delta = linear.lora_B.weight.float() @ linear.lora_A.weight.float()
        linear.weight.add_((delta * linear.lora_scaling).to(linear.weight.dtype))
        linear.lora_handle.remove()
        for attr in ("lora_A", "lora_B", "lora_dropout", "lora_scaling", "lora_handle"):
            delattr(linear, attr)
    merge_expert_adapters(model)
    return model


@torch.no_grad()
def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA model's whole state dict (plain names) as its base's names and shapes, every
    adapter folded in (W + scaling B A; a routed expert's W_e + scaling (B_e A_e)^T): what an
    engine that cannot run adapters loads. `state` itself is left as it is."""
    out = {k: v for k, v in state.items() if ".lora_" not in k}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):  # a linear layer's: A (rank, in), B (out, rank)
            module = key.removesuffix(".lora_A.weight")
            delta = state[f"{module}.lora_B.weight"].float() @ a.float()
            target = f"{module}.weight"
        elif key.endswith(".lora_A"):  # routed experts': A (E, rank, in), B (E, out, rank)
            module = key.removesuffix(".lora_A")
            b = state[f"{module}.lora_B"].float()
            delta = torch.bmm(a.float().transpose(1, 2), b.transpose(1, 2))
            owner, proj = module.rsplit(".adapters.", 1)
            target = f"{owner}.{proj}"
        else:
            continue
        weight = out[target]
        out[target] = (weight.float() + scaling * delta).to(weight.dtype)
    return out


def lora_trainer_options(
    config: LoRAConfig | None, *, precision: str = "fp32", device_type: str = "cpu"
) -> dict:
    """`Trainer(cfg, info, **lora_trainer_options(cfg.lora, precision=cfg.train.precision,
    device_type=info.device.type))`: the LoRA `after_tp` hook and adapter-only checkpoints
    when `config.rank > 0`, else nothing (full fine-tuning).

    Raises:
        ConfigError: QLoRA on a precision or device it cannot serve (`qlora.check_qlora`).
    """
    if config is None or not config.enabled:
        return {}
    if config.quantize == "nf4":
        from mindspeed_llm.peft.qlora import check_qlora

        check_qlora(precision, device_type)
    return {"after_tp": lora_transform(config), "adapter_only": True}
