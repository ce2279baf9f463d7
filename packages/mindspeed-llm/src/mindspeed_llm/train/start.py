"""Where a run's policy starts, in one place.

A run's policy starts from its seed (or `model.hf_path`) and then, optionally, a warm
start: a state dict a demo trained first, or a folder (a Hugging Face model or a run's
checkpoints, e.g. `grpo.init_from`). `StartingWeights` holds that warm start; the trainer
gives it to the policy, and `starting_model` builds the policy again as it started (a
frozen reference, a KL anchor, a critic's trunk), on this process's layout or, on a Ray
actor, on its own. No other code loads the warm start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError

__all__ = ["StartingWeights", "load_init_state", "load_weights", "set_weights", "starting_model"]


@dataclass(frozen=True)
class StartingWeights:
    """A run's warm start, given to every model built as the policy started."""

    state: dict[str, Any] | None = None
    """A model state dict (e.g. a demo's warm-up), loaded as it is."""
    path: Path | None = None
    """A folder of weights (Hugging Face or a run's checkpoints), loaded after `state`."""
    key: str = "init_from"
    """The config field that named `path` (errors name it)."""
    partial: bool = False
    """`state` and `path` may lack the LoRA adapters (an adapter-only run: its adapters
    start as drawn, on the base these weights give)."""

    def give(self, built: Any, *, head: bool = True) -> None:
        """Load the warm start into `built` (a `BuiltModel`, or a whole `nn.Module`);
        `head=False` keeps the model's own output layer (a critic's value head)."""
        model = built if isinstance(built, nn.Module) else built.model
        if self.state is not None:
            state = self.state if head else {k: v for k, v in self.state.items()
                                             if not k.startswith("output.")}  # fmt: skip
            load_init_state(model, state, partial=self.partial, head=head)
        if self.path is not None:
            load_weights(built, self.path, what=self.key, head=head, partial=self.partial)


def starting_model(
    build: Callable[..., Any],
    start: StartingWeights | None,
    *,
    frozen: bool = True,
    head: bool = True,
    **options: Any,
) -> Any:
    """The policy as the run started it: `build(frozen=frozen, **options)` (a run's
    `build_model`: its config, layout, seed or Hugging Face weights), then the warm start."""
    built = build(frozen=frozen, **options)
    if start is not None:
        start.give(built, head=head)
    return built


def load_init_state(
    model: nn.Module, state: dict[str, Any], *, partial: bool = False, head: bool = True
) -> None:
    """`state` into `model`, every key; with `partial` (a LoRA model) the adapters may be
    missing from it, with `head=False` (a critic keeping its value head) the output layer."""
    missing, unexpected = model.load_state_dict(state, strict=not partial and head)
    allowed = ("lora_",) * partial + ("output.",) * (not head)
    if (partial or not head) and (
        unexpected or any(not any(a in name for a in allowed) for name in missing)
    ):
        raise ValueError(
            f"the starting weights do not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )


def load_weights(
    built: Any, path: Path, *, what: str = "init_from", head: bool = True, partial: bool = False
) -> None:
    """Replace a model's weights (a `BuiltModel`, whole or sharded, or a whole module) with
    those at `path`; `head=False` keeps the model's own output layer (a critic's value head
    on a language model's body), `partial` its LoRA adapters (`path` holds a base)."""
    from mindspeed_llm.loading import load_model

    model = built if isinstance(built, nn.Module) else built.model
    device = next(model.parameters()).device if isinstance(built, nn.Module) else built.device
    source, _ = load_model(path, device=device)
    full = source.state_dict()
    if not head:
        full.pop("output.weight", None)
    set_weights(model, full, path=path, what=what, head=head, partial=partial)


def set_weights(
    model: nn.Module, full: dict, *, path, what: str, head: bool, partial: bool = False
) -> None:
    """Load the whole tensors `full` into a (whole or sharded) model; with `partial` its
    LoRA adapters may be missing from `full`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    try:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            options = StateDictOptions(full_state_dict=True, strict=head and not partial)
            result = set_model_state_dict(model, full, options=options)
            missing, unexpected = (result or ([], [])) if partial else ([], [])
        else:
            missing, unexpected = model.load_state_dict(full, strict=False)
        missing = [k for k in missing if not (partial and ".lora_" in k)]
        if unexpected or (head and missing) or set(missing) - {"output.weight"}:
            raise RuntimeError(f"missing {missing}, unexpected {unexpected}")
    except (RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"{what}={path}: its model does not fit the model section ({first})"
        ) from None
