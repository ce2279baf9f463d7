"""Every number a command reads is checked at load: NaN and infinities are refused for every
float field of every installed command's config (table-driven, so a new field is covered by
default), naming the field; out-of-range values of the fields that have ranges are refused by
their sections (one example per section kind here)."""

import dataclasses
import re
import typing

import pytest

from mindspeed_core.cli import discover_commands
from mindspeed_core.config import config_from_args
from mindspeed_core.errors import ConfigError


def _float_fields(cls: type, prefix: str = ""):
    """(dotted path, items: 0 for a number, -1 for a mapping to numbers, else how many a
    sequence of floats holds) of every float field of a config dataclass tree."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        nested = [t for t in (tp, *inner) if dataclasses.is_dataclass(t)]
        if nested:
            yield from _float_fields(nested[0], prefix + field.name + ".")
        elif typing.get_origin(tp) is dict:
            if float in typing.get_args(tp)[1:]:
                yield prefix + field.name, -1  # a mapping to floats
        elif typing.get_origin(tp) in (list, tuple) and float in typing.get_args(tp):
            args = typing.get_args(tp)
            yield prefix + field.name, len(args) if typing.get_origin(tp) is tuple else 1
        elif float in (tp, *inner):
            yield prefix + field.name, 0


def _configs() -> dict[str, type]:
    found = {}
    for name, entry in sorted(discover_commands().items()):
        command = entry.load()
        if command.config_cls is not None:
            found[name] = command.config_cls
    return found


def test_every_float_field_of_every_command_refuses_nan_and_inf():
    configs = _configs()
    assert {"pretrain", "sft", "dpo", "grpo", "ppo", "rm", "kto"} <= set(configs)
    checked = 0
    for name, cls in configs.items():
        for path, items in _float_fields(cls):
            for bad in ("nan", "inf", "-inf"):
                value = f"{{x: {bad}}}" if items < 0 else f"[{', '.join([bad] * items)}]" if items else bad
                with pytest.raises(ConfigError, match=re.escape(path)) as err:
                    config_from_args(cls, [f"--{path}", value])
                assert "finite number" in str(err.value), (name, path, str(err.value))
            checked += 1
    assert checked >= 100, checked  # every command's optimizer, losses, rollouts ...


def test_an_optimizer_section_names_itself():
    configs = _configs()
    with pytest.raises(ConfigError, match=r"critic\.lr=-1.0 must be a positive finite number"):
        config_from_args(configs["ppo"], ["--critic.lr", "-1"])
    with pytest.raises(ConfigError, match=r"optim\.lr=-1.0 must be a positive finite number"):
        config_from_args(configs["ppo"], ["--optim.lr", "-1"])
