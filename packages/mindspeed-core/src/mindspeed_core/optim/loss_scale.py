"""Dynamic loss scaling for fp16 training, correct when gradients are sharded.

Multiply the loss by a scale before backward so small fp16 gradients do not
underflow; before the optimizer step, divide the gradients by it and check them
for inf/nan on every rank (a shard on one rank may overflow while the others do
not, so the verdict is all-reduced). An overflow skips the step and halves the
scale (after `hysteresis` overflows in a row, as Megatron does); `growth_interval`
clean steps in a row double it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import dtensor


class DynamicLossScaler(Stateful):
    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ConfigError(
                "loss scaling needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1 "
                f"(got {init_scale}, {growth_factor}, {backoff_factor})"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._clean_steps = 0
        self._overflows_left = hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Divide gradients by the scale in place; True when any rank saw inf or nan."""
        grads = [p.grad for p in parameters if p.grad is not None]
        local = [dtensor.local(g) for g in grads]
        found = torch.zeros((), dtype=torch.float32, device=local[0].device if local else "cpu")
        for g in local:
            g.mul_(1.0 / self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (call every step, skipped or not)."""
        if found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_left = self.hysteresis
            return
        self._clean_steps += 1
        self._overflows_left = self.hysteresis
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_left": self._overflows_left,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scale = float(state_dict["scale"])
        self._clean_steps = int(state_dict["clean_steps"])
        self._overflows_left = int(state_dict["overflows_left"])
