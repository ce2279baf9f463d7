"""AdamW with its two moments stored in bf16: half the optimizer state of fp32 moments.

The arithmetic is torch's AdamW (`torch.optim.adam._single_tensor_adam`, decoupled weight
decay) in fp32: each parameter's moments are read up to fp32, updated with its gradient,
used for the parameter's update at full precision, and only then stored back rounded to
bf16 (as torchao's `single_param_adam` and Megatron's precision-aware optimizer do). One
parameter at a time, so the fp32 copies cost one parameter's worth of memory, not the
whole state's. The state keeps torch's names (`step`, `exp_avg`, `exp_avg_sq`), in the
parameter's layout (DTensor shards for sharded parameters), so a checkpoint of either
dtype loads into the other.

torch's own AdamW step cannot do this: its kernels want moments of the parameter's dtype,
and `Optimizer.load_state_dict` casts a loaded state to the parameter's dtype (undone here
after loading). torchao's 8-bit AdamW is not offered: its blocks quantise each rank's
local shard, so its state depends on the layout, and it wants a tensor learning rate that
our schedules do not set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PerParameterStep:
    """An optimizer's `step` as one `_update(p, group)` per parameter with a gradient (the
    optimizers here whose update is written per tensor)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss


class LowPrecisionAdamW(PerParameterStep, torch.optim.AdamW):
    """AdamW whose moments are stored in `state_dtype` and updated in fp32.

    A `torch.optim.AdamW` (same parameter-group settings, so either one's checkpoint loads
    into the other) with its own step; amsgrad, maximize and the foreach/fused kernels are
    not offered.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False)  # fmt: skip
        self.state_dtype = state_dtype

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        state["step"] += 1
        step = state["step"].item()
        (beta1, beta2), lr = group["betas"], group["lr"]
        param, grad = _local(p), _local(grad_like_param(p)).float()
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        param.mul_(1 - lr * group["weight_decay"])
        m = exp_avg.float().lerp_(grad, 1 - beta1)
        v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        param.addcdiv_(m, denom, value=-step_size)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # casts the moments to the parameters' dtype
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grad_like_param(p: Tensor) -> Tensor:
    """`p.grad` laid out as `p` (a DTensor's gradient may come in another placement, e.g.
    replicated for a vocabulary-sharded embedding), so local blocks line up."""
    grad = p.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def state_bytes(optimizers) -> int:
    """Bytes of the optimizer state this rank holds (its shards of every state tensor)."""
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    local = _local(value)
                    total += local.numel() * local.element_size()
    return total
