"""Stateful wrappers for what a training run checkpoints besides the optimizer.

- `ModelState`: the model parts' parameters and buffers, keyed by their names,
  sharded tensors kept as DTensors so they load into any other layout.
- `RNGState`: this rank's random generators (CPU and accelerator), saved under a
  per-rank key; a rank that has no saved state (a larger world) keeps its own.
- `TrainState`: the step and token counters and any small extras.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint.saved import param_like, restored_state, saved_params, saved_state


class ModelState(Stateful):
    """The state of one model or of the pipeline stages a rank holds.

    With `trainable_only` it leaves out the frozen parameters (a frozen base under adapters,
    which the run rebuilds from its source; buffers stay) and loads non-strictly;
    `frozen_only` is the other half (the base alone, e.g. from a converted checkpoint).
    A part that declares `saved_params()` is saved as it declares (padding rows left out;
    see `mindspeed_core.checkpoint.saved`).
    """

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        *,
        trainable_only: bool = False,
        frozen_only: bool = False,
    ):
        self.model_parts = (
            [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        )
        self.trainable_only, self.frozen_only = trainable_only, frozen_only

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        options = StateDictOptions(ignore_frozen_params=self.trainable_only)
        for part in self.model_parts:
            state = get_model_state_dict(part, options=options)
            merged.update(saved_state(state, saved_params(part)))
        if self.frozen_only:  # everything but what the trainable-only state holds
            trainable = ModelState(self.model_parts, trainable_only=True).state_dict()
            merged = {k: v for k, v in merged.items() if k not in trainable}
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: each pipeline stage takes only its own names from the merged dict.
        partial = self.trainable_only or self.frozen_only
        options = StateDictOptions(strict=len(self.model_parts) == 1 and not partial)
        for part in self.model_parts:
            own = restored_state(state_dict, saved_params(part), param_like(part))
            set_model_state_dict(part, own, options=options)


class RNGState(Stateful):
    """Random-generator state of this rank (per-rank: see `CheckpointManager`)."""

    per_rank = True

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")

    def _key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type != "cpu":
            module = torch.get_device_module(self.device.type)
            state["device"] = module.get_rng_state(self.device)
        return {self._key(): state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get(self._key())
        if state is None:
            return
        torch.set_rng_state(state["cpu"])
        if "device" in state and self.device.type != "cpu":
            torch.get_device_module(self.device.type).set_rng_state(state["device"], self.device)


@dataclass
class TrainState(Stateful):
    """Counters of a training run; `extra` holds small picklable values (ints, floats, str)."""

    step: int = 0
    tokens_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "extra": dict(self.extra)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.extra = dict(state_dict.get("extra", {}))
