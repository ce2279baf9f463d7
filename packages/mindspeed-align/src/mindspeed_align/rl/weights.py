"""A critic's weights from a trained reward model (the warm start of a policy, and of the
models built as it started, is `mindspeed_llm.train.start`'s)."""

from __future__ import annotations

from pathlib import Path

from mindspeed_core.errors import ConfigError
from mindspeed_llm.train.start import set_weights

__all__ = ["load_value_model"]


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
    set_weights(built.model, source.state_dict(), path=path, what=what, head=True)
