"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD decay.

The multiplier of the base LR for optimizer step ``s`` (0-based):

- warmup, ``s < warmup_steps``: ``(s + 1) / warmup_steps``;
- then with ``p`` the fraction of the decay phase done (clipped to [0, 1]) and
  ``m = min_lr_ratio``:
  cosine ``m + (1 - m) * (1 + cos(pi p)) / 2``, linear ``1 - (1 - m) p``, constant ``1``;
- WSD (warmup-stable-decay): ``1`` until the last ``decay_steps`` steps, then linear
  down to ``m``.

Schedulers are `LambdaLR`s, so their state is just the step count and a resumed
run continues on exactly the same curve.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from mindspeed_core.errors import ConfigError

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_style: str,
    min_lr_ratio: float = 0.0,
    decay_steps: int | None = None,
) -> float:
    """The factor applied to the base LR at optimizer step `step` (see module doc)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    if decay_style == "wsd":
        span = decay_steps if decay_steps is not None else total_steps - warmup_steps
        start = total_steps - span
    else:
        start, span = warmup_steps, total_steps - warmup_steps
    progress = min(max((step - start) / max(span, 1), 0.0), 1.0)
    if decay_style == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - min_lr_ratio) * progress


class LRSchedulersContainer(Stateful):
    """One `LambdaLR` per optimizer of an `OptimizersContainer`, stepped together."""

    def __init__(
        self,
        optimizers,
        *,
        warmup_steps: int,
        total_steps: int,
        decay_style: str = "cosine",
        min_lr_ratio: float = 0.0,
        decay_steps: int | None = None,
    ):
        _validate(warmup_steps, total_steps, decay_style, min_lr_ratio, decay_steps)
        fn = partial(
            lr_multiplier,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            decay_style=decay_style,
            min_lr_ratio=min_lr_ratio,
            decay_steps=decay_steps,
        )
        self.schedulers = [LambdaLR(opt, fn) for opt in optimizers]

    def step(self) -> None:
        for sched in self.schedulers:
            sched.step()

    def get_last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        # Every scheduler has the same step count; the lambda itself is rebuilt from config.
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        last = int(state_dict["last_epoch"])
        for sched in self.schedulers:
            sched.last_epoch = last
            # Recompute the LR for the restored step (what step() would have set).
            for group, lr in zip(sched.optimizer.param_groups, _lrs_at(sched, last), strict=True):
                group["lr"] = lr
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]


def _lrs_at(sched: LambdaLR, step: int) -> list[float]:
    return [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]


def build_lr_schedulers(optimizers, **kwargs) -> LRSchedulersContainer:
    """An `LRSchedulersContainer` over an `OptimizersContainer` (or a list of optimizers)."""
    return LRSchedulersContainer(optimizers, **kwargs)


def _validate(warmup_steps, total_steps, decay_style, min_lr_ratio, decay_steps) -> None:
    if decay_style not in DECAY_STYLES:
        raise ConfigError(f"lr decay_style {decay_style!r}; choose one of {DECAY_STYLES}")
    if warmup_steps < 0 or total_steps < 1:
        raise ConfigError(
            f"lr schedule needs warmup_steps >= 0 and total_steps >= 1 "
            f"(got {warmup_steps} and {total_steps})"
        )
    if warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio={min_lr_ratio} must lie in [0, 1]")
    if decay_steps is not None and not 0 <= decay_steps <= total_steps - warmup_steps:
        raise ConfigError(
            f"wsd decay_steps={decay_steps} must lie in [0, total_steps - warmup_steps "
            f"= {total_steps - warmup_steps}]"
        )
