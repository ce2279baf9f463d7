"""Loading a run's starting weights into a built (whole or sharded) model."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError

__all__ = ["load_value_model", "load_weights", "set_weights"]


def load_weights(built, path: Path, *, what: str = "grpo.init_from", head: bool = True) -> None:
    """Replace a built model's weights (whole or sharded) with those at `path`; `head=False`
    keeps the model's own output layer (a critic's value head on a language model's body)."""
    from mindspeed_llm.loading import load_model

    source, _ = load_model(path, device=built.device)
    full = source.state_dict()
    if not head:
        full.pop("output.weight", None)
    set_weights(built, full, path=path, what=what, head=head)


def load_value_model(built, path: Path, *, what: str = "critic.init_from") -> None:
    """A critic's weights, value head included, from a reward model exported as a Hugging
    Face `*ForSequenceClassification` folder (`mindspeed rm --rm.export_hf`)."""
    from mindspeed_align.reward import load_classifier

    if not Path(path).is_dir():
        raise ConfigError(f"{what}={path} does not exist")
    try:
        source, _, _ = load_classifier(Path(path), device=built.device)
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None
    set_weights(built, source.state_dict(), path=path, what=what, head=True)


def set_weights(built, full: dict, *, path, what: str, head: bool) -> None:
    """Load the whole tensors `full` into a built (whole or sharded) model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = built.model
    try:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            options = StateDictOptions(full_state_dict=True, strict=head)
            set_model_state_dict(model, full, options=options)
        else:
            missing, unexpected = model.load_state_dict(full, strict=False)
            if unexpected or (head and missing) or set(missing) - {"output.weight"}:
                raise RuntimeError(f"missing {missing}, unexpected {unexpected}")
    except (RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"{what}={path}: its model does not fit the model section ({first})"
        ) from None
