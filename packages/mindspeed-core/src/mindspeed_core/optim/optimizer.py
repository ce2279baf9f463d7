"""The optimizer container: per model part AdamW, or Muon plus AdamW, checkpointable
across layouts.

One set of optimizers per model part keeps pipeline stages independent (each rank holds
only its stages); the container steps, zeroes and checkpoints them together.
Parameters with fewer than two dimensions (biases, norm scales) get no weight
decay, as in Megatron-LM and nanoGPT. With `name="muon"` the model's hidden matrices
(`muon.hidden_matrices`) go to Muon and everything else to AdamW, as Moonshot and
torch's `torch.optim.Muon` documentation do; both share the learning rate, its schedule
and the weight decay. `state_dtype="bf16"` stores AdamW's moments in bf16 (`adamw`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from mindspeed_core import device as dev
from mindspeed_core.checkpoint.saved import (
    optimizer_key,
    restored_state,
    saved_params,
    saved_state,
)
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim.adamw import STATE_DTYPES, LowPrecisionAdamW, state_bytes
from mindspeed_core.optim.muon import Muon, hidden_matrices

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
OPTIMIZERS = ("adamw", "muon")


def param_groups(
    model: nn.Module, weight_decay: float, *, skip: Iterable[nn.Parameter] = ()
) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, vectors and scalars do not.

    Groups are also split by where a parameter lives (plain tensor, or DTensor on a
    given mesh): foreach and fused kernels cannot mix the two in one call, and a
    tensor-parallel model keeps unsharded weights (a head, say) as plain tensors.
    Parameters in `skip` (another optimizer's) are left out.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    skipped = {id(p) for p in skip}
    for param in model.parameters():
        if not param.requires_grad or id(param) in skipped:
            continue
        decay = param.dim() >= 2
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        key = (not decay, id(mesh) if mesh is not None else 0)
        group = groups.setdefault(
            key, {"params": [], "weight_decay": weight_decay if decay else 0.0}
        )
        group["params"].append(param)
    return list(groups.values())


def check_adamw_args(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    *,
    section: str = "optim",
) -> None:
    """Refuse AdamW settings torch would reject with a traceback (or accept and diverge on).

    Raises:
        ConfigError: naming the field as `<section>.<name>` and its value.
    """
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{section}.lr={lr} must be a positive finite number")
    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps > 0):
        raise ConfigError(f"{section}.eps={eps} must be a positive finite number")
    if not (isinstance(weight_decay, int | float) and 0 <= weight_decay < math.inf):
        raise ConfigError(f"{section}.weight_decay={weight_decay} must be a finite number >= 0")
    try:
        pair = tuple(float(b) for b in betas)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or not all(0.0 <= b < 1.0 for b in pair):
        raise ConfigError(
            f"{section}.betas={list(betas) if isinstance(betas, (list, tuple)) else betas} must be two numbers in [0, 1)"
        )


def _impl_flags(implementation: str, device_type: str) -> dict[str, bool]:
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"optimizer implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
        )
    if implementation == "auto":
        # torch's fused AdamW is fastest on CUDA; foreach works everywhere, DTensors included.
        implementation = "fused" if dev.prefers_fused_optimizer(device_type) else "foreach"
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


class OptimizersContainer(Stateful):
    """The optimizers of each model part (AdamW; or Muon and AdamW), stepped and
    checkpointed as one.

    The state dict is keyed by parameter names with the optimizer state of each
    parameter as a whole (DTensor) tensor, so it loads into any other layout; which
    optimizer holds a parameter shows only in its state's names (`exp_avg`, `exp_avg_sq`
    and `step` for AdamW, `momentum_buffer` for Muon).

    Args:
        name: "adamw", or "muon" for Muon on the hidden matrices and AdamW on the rest.
        state_dtype: "fp32" (torch's AdamW) or "bf16" (`LowPrecisionAdamW`) moments.
        muon: Muon's own settings (`Muon`'s arguments: momentum, ns_steps, adjust_lr_fn,
            ns_dtype).
        pp_group: the pipeline group, where a stage may hold no matrix (name="muon"
            refuses a model without any, counted over all stages).
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        implementation: str = "auto",
        name: str = "adamw",
        state_dtype: str = "fp32",
        muon: dict[str, Any] | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ):
        check_adamw_args(lr, betas, eps, weight_decay)
        check_choice("name", name, OPTIMIZERS)
        check_choice("state_dtype", state_dtype, tuple(STATE_DTYPES))
        self.model_parts = list(model_parts)
        flags = _impl_flags(implementation, _device_type(self.model_parts))
        # the fused kernels skip a non-finite step on the device (`step(skip_if=)`); Muon and
        # bf16 moments have no such kernel
        self.fused = bool(flags.get("fused")) and name == "adamw" and state_dtype == "fp32"
        matrices = [
            [p for _, p in hidden_matrices(m)] if name == "muon" else [] for m in self.model_parts
        ]
        if name == "muon":
            _require_matrices(sum(map(len, matrices)), pp_group)

        def adamw(groups):
            if state_dtype == "fp32":
                return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **flags)
            dtype = STATE_DTYPES[state_dtype]
            return LowPrecisionAdamW(groups, lr=lr, betas=betas, eps=eps, state_dtype=dtype)

        self.part_optimizers: list[list[torch.optim.Optimizer]] = []
        for model, mine in zip(self.model_parts, matrices, strict=True):
            groups = param_groups(model, weight_decay, skip=mine)
            part = [adamw(groups)] if groups or not mine else []
            if mine:
                part.append(Muon(mine, lr=lr, weight_decay=weight_decay, **(muon or {})))
            self.part_optimizers.append(part)
        self.optimizers = [opt for part in self.part_optimizers for opt in part]

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, skip_if: torch.Tensor | None = None) -> None:
        """One AdamW step of every part.

        Args:
            skip_if: a bool scalar tensor; true: no update (a non-finite loss or gradient).
                The fused kernels take it on the device (torch's `found_inf`, as its
                GradScaler passes it), so the host reads nothing; the other kernels read it
                on the host first.
        """
        if skip_if is not None and not self.fused:
            if bool(skip_if):
                return
            skip_if = None
        for opt in self.optimizers:
            if skip_if is None:
                opt.step()
                continue
            opt.found_inf = skip_if.to(torch.float32)  # torch's amp protocol for AdamW
            try:
                opt.step()
            finally:
                del opt.found_inf

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def parameters(self) -> Iterable[nn.Parameter]:
        for opt in self.optimizers:
            for group in opt.param_groups:
                yield from group["params"]

    def state_dict(self) -> dict[str, Any]:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict[str, Any] = {}
        for model, opts in zip(self.model_parts, self.part_optimizers, strict=True):
            state = get_optimizer_state_dict(model, opts, options=options)
            merged.update(saved_state(state, saved_params(model, optimizer=True), optimizer_key))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for model, opts in zip(self.model_parts, self.part_optimizers, strict=True):
            like = dict(model.named_parameters())  # the names the flattened state uses
            params = saved_params(model, optimizer=True)
            own = restored_state(state_dict, params, like, optimizer_key)
            set_optimizer_state_dict(model, opts, own, options=options)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (its shards; after the first step)."""
        return state_bytes(self.optimizers)


class OptimizerMoments(Stateful):
    """The per-parameter state of an `OptimizersContainer` (Adam's moments and step) without
    its parameter groups: a checkpoint converted from another framework carries the state,
    while lr, betas, eps and weight decay stay as this run's config sets them."""

    def __init__(self, optimizers: OptimizersContainer):
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizers.state_dict().items() if k.startswith("state.")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        merged = self.optimizers.state_dict()  # this run's parameter groups
        merged.update(state_dict)
        self.optimizers.load_state_dict(merged)


def build_optimizers(model_parts: nn.Module | Sequence[nn.Module], **kwargs) -> OptimizersContainer:
    """An `OptimizersContainer` over one module or a list of pipeline-stage modules."""
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    return OptimizersContainer(parts, **kwargs)


def check_choice(field: str, value: str, choices: tuple[str, ...], section: str = "optim") -> None:
    """Refuse `value` outside `choices`, naming `<section>.<field>`."""
    if value not in choices:
        raise ConfigError(f"optim.{field}={value!r}; choose one of {list(choices)}")


def _require_matrices(count: int, pp_group: dist.ProcessGroup | None) -> None:
    """Muon needs at least one matrix in the model (over all pipeline stages)."""
    if pp_group is not None:
        counts: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(counts, count, group=pp_group)
        count = sum(counts)
    if count == 0:
        raise ConfigError(
            "optim.name=muon: no trainable hidden matrix to orthogonalise (Muon takes the "
            "blocks' 2-D weights; embeddings, frozen weights and LoRA adapters are not); "
            "use optim.name=adamw"
        )


def _device_type(parts: Sequence[nn.Module]) -> str:
    for part in parts:
        for param in part.parameters():
            return param.device.type
    return "cpu"
