"""Strict YAML configuration onto nested dataclasses, with dotted CLI overrides.

A config is a tree of `@dataclass(kw_only=True)` classes, each defined next to
the component it configures. This module maps YAML and `--section.field value`
overrides onto that tree:

- strict: an unknown key is an error that suggests the nearest valid key;
- typed: values are converted to the field's annotation (bool, int, float, str,
  Path, enums, Literal, Optional, lists, tuples, dicts, nested dataclasses);
- located: every error names the file and line, or the override, it came from;
- reversible: `to_dict` / `dump_yaml` give back YAML that loads to an equal object.

Example:
    cfg = config_from_args(TrainConfig, ["--config", "run.yaml", "--optim.lr", "3e-4"])
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mindspeed_core.errors import ConfigError
from mindspeed_core.files import read_text

T = TypeVar("T")
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~"}


class _Origins:
    """Where each dotted key came from, for error messages ("run.yaml:7", "--optim.lr")."""

    def __init__(self, default: str = "<config>", root_paths: list[str] | None = None):
        self.default = default
        self.by_path: dict[str, str] = {}
        # Every leaf path of the root config, so a misplaced key can be matched
        # against other sections too.
        self.root_paths = root_paths or []

    def within(self, section: str) -> str:
        """The origin of the last value set inside `section` (for a section's own checks)."""
        inside = [o for p, o in self.by_path.items() if p == section or p.startswith(section + ".")]
        return inside[-1] if inside else self.of(section)

    def of(self, path: str) -> str:
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path.rpartition(".")[0]
        return self.default


# ---------------------------------------------------------------- dict -> dataclass


def from_dict(
    cls: type[T],
    data: Mapping[str, Any] | None,
    *,
    source: str = "<config>",
    _origins: _Origins | None = None,
    _prefix: str = "",
) -> T:
    """Build dataclass `cls` from a nested mapping, strictly.

    Raises:
        ConfigError: unknown key (with a suggestion), missing required field,
            value of the wrong type, or a field's own check failing.
    """
    origins = _origins or _Origins(source, field_paths(cls))
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        where = _prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"{origins.of(_prefix.rstrip('.'))}: {where} must be a mapping, got {_describe(data)}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown_key(cls, _prefix + str(key), origins)
    kwargs = {}
    for name, field in fields.items():
        path = _prefix + name
        if name in data:
            value = data[name]
            if isinstance(value, Mapping) and field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()  # a section given in part keeps the
                if dataclasses.is_dataclass(default):  # defaults its owner chose for the rest
                    value = {**to_dict(default), **value}
            kwargs[name] = _convert(value, hints[name], path, origins)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{origins.of(_prefix.rstrip('.'))}: missing required field '{path}'")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        where = _prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{origins.within(_prefix.rstrip('.'))}: {where}: {e}") from None


def _convert(value: Any, tp: Any, path: str, origins: _Origins) -> Any:  # noqa: C901
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union or origin is types.UnionType:
        return _convert_union(value, args, path, origins)
    if origin is typing.Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise _type_error(value, f"one of {list(args)}", path, origins)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, _origins=origins, _prefix=path + ".")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _convert_enum(value, tp, path, origins)
    if tp is bool:
        return _convert_bool(value, path, origins)
    if tp in (int, float):
        return _convert_number(value, tp, path, origins)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(value, "a string", path, origins)
    if tp is Path or (isinstance(tp, type) and issubclass(tp, Path)):
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _type_error(value, "a path", path, origins)
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(value, tp, origin or tp, args, path, origins)
    if origin is dict or tp is dict:
        return _convert_dict(value, args, path, origins)
    raise ConfigError(f"{path}: unsupported field type {tp!r}")  # a schema bug, not user input


def _convert_union(value, args, path, origins):
    if type(None) in args and (
        value is None or (isinstance(value, str) and value.lower() in _NONE)
    ):
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, path, origins)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
    raise _type_error(value, names, path, origins)


def _convert_enum(value, tp, path, origins):
    for member in tp:
        if value == member.value or value is member:
            return member
        if isinstance(value, str) and value.lower() in (
            member.name.lower(),
            str(member.value).lower(),
        ):
            return member
    raise _type_error(value, f"one of {[m.value for m in tp]}", path, origins)


def _convert_bool(value, path, origins):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _type_error(value, "true or false", path, origins)


def _convert_number(value, tp, path, origins):
    if isinstance(value, bool):
        raise _type_error(value, "an integer" if tp is int else "a number", path, origins)
    if isinstance(value, str):
        try:
            value = int(value) if tp is int else float(value)
        except ValueError:
            raise _type_error(
                value, "an integer" if tp is int else "a number", path, origins
            ) from None
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise _type_error(value, "an integer", path, origins)
        return value
    if isinstance(value, (int, float)):
        if not math.isfinite(value):  # NaN or inf: every step would be skipped or diverge
            raise _type_error(value, "a finite number", path, origins)
        return float(value)
    raise _type_error(value, "a number", path, origins)


def _convert_sequence(value, tp, container, args, path, origins):
    if isinstance(value, str):  # from the command line: "[1, 2]" or "1,2"
        text = value.strip()
        value = (
            _parse_yaml_scalar(text, path, origins)
            if text.startswith("[")
            else ([] if not text else [v.strip() for v in text.split(",")])
        )
    if not isinstance(value, (list, tuple)):
        raise _type_error(value, "a list", path, origins)
    if container is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _type_error(value, f"a list of {len(args)} items", path, origins)
        return tuple(
            _convert(v, a, f"{path}[{i}]", origins)
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    item_tp = args[0] if args else Any
    items = [_convert(v, item_tp, f"{path}[{i}]", origins) for i, v in enumerate(value)]
    return tuple(items) if container is tuple else items


def _convert_dict(value, args, path, origins):
    if isinstance(value, str):
        value = _parse_yaml_scalar(value, path, origins)
    if not isinstance(value, Mapping):
        raise _type_error(value, "a mapping", path, origins)
    key_tp, val_tp = args if args else (Any, Any)
    return {
        _convert(k, key_tp, path, origins): _convert(v, val_tp, f"{path}.{k}", origins)
        for k, v in value.items()
    }


def _parse_yaml_scalar(text: str, path: str, origins: _Origins) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"{origins.of(path)}: {path}: cannot parse {text!r}") from None


def _describe(value: Any) -> str:
    kind = "null" if value is None else type(value).__name__
    return f"{value!r} ({kind})" if not isinstance(value, (dict, list)) else kind


def _type_error(value, expected, path, origins) -> ConfigError:
    return ConfigError(f"{origins.of(path)}: {path}: expected {expected}, got {_describe(value)}")


def _unknown_key(cls: type, path: str, origins: _Origins) -> ConfigError:
    hint = _suggest(
        path,
        field_paths(cls, prefix=path.rpartition(".")[0] + "." if "." in path else ""),
        origins.root_paths,
    )
    return ConfigError(f"{origins.of(path)}: unknown key '{path}'{hint}")


def _suggest(path: str, section_paths: list[str], root_paths: list[str]) -> str:
    """'; did you mean X?' for the nearest valid key, or ''."""
    key = path.rpartition(".")[2]
    # 1. the same name in another section ("train.lr" -> "optim.lr")
    guesses = [p for p in root_paths if p.rpartition(".")[2] == key]
    # 2. a near spelling in the same section, then 3. a near name anywhere
    guesses = guesses or difflib.get_close_matches(path, section_paths, n=1, cutoff=0.6)
    if not guesses:
        by_leaf = {p.rpartition(".")[2]: p for p in root_paths or section_paths}
        leaf = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.75)
        guesses = [by_leaf[leaf[0]]] if leaf else []
    return f"; did you mean '{guesses[0]}'?" if guesses else ""


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf path of a dataclass tree, e.g. ['optim.lr', 'parallel.tp', ...]."""
    hints = typing.get_type_hints(cls)
    paths = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            paths += field_paths(tp, prefix + f.name + ".")
        elif len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            paths += field_paths(inner[0], prefix + f.name + ".")
        else:
            paths.append(prefix + f.name)
    return paths


# ---------------------------------------------------------------- dataclass -> dict / YAML


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config: dicts, lists and scalars (enums by value, paths as str)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any, path: str | Path | None = None) -> str:
    """Write the fully resolved config as YAML (to `path` if given) and return the text."""
    text = yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


# ---------------------------------------------------------------- YAML files and overrides


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a YAML mapping and the line of every dotted key in it.

    Raises:
        ConfigError: the file is missing, malformed, not a mapping, or repeats a key.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    text = read_text(path, "config file", error=ConfigError)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    lines: dict[str, int] = {}
    _collect_lines(node, "", path, lines)
    return data, lines


def _collect_lines(node: yaml.Node, prefix: str, path: Path, lines: dict[str, int]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = prefix + str(key_node.value)
        if key in seen:
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: key '{key}' appears twice")
        seen.add(key)
        lines[key] = key_node.start_mark.line + 1
        _collect_lines(value_node, key + ".", path, lines)


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """Split `--a.b value`, `--a.b=value` and bare `--flag` into (dotted key, raw value).

    Raises:
        ConfigError: an argument is not of those forms.
    """
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.field value"
            )
        key, eq, value = arg[2:].partition("=")
        if eq:
            out.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((key, args[i + 1]))
            i += 1
        else:
            out.append((key, None))  # a bare flag: true for a bool field
        i += 1
    return out


def _check_override_path(cls: type, key: str, root_paths: list[str]) -> None:
    """Every part of a dotted override but the last must name a section (or a dict field)."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(cls)
        here = ".".join(parts[: i + 1])
        if part not in hints:
            raise ConfigError(
                f"--{key}: unknown key '{here}'"
                f"{_suggest(here, field_paths(cls, here.rpartition('.')[0] + '.' if i else ''), root_paths)}"
            )
        tp = hints[part]
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 and typing.get_origin(tp) is not dict else tp
        if typing.get_origin(tp) is dict or tp is dict:
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"--{key}: '{here}' is a value, not a section")
        cls = tp


def apply_overrides(
    data: dict[str, Any],
    overrides: Sequence[tuple[str, str | None]],
    origins: _Origins | None = None,
) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set (values stay raw strings)."""
    import copy

    data = copy.deepcopy(data)
    for key, value in overrides:
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"--{key}: '{'.'.join(parts[: i + 1])}' is a value, not a section"
                )
            node = child
        node[parts[-1]] = "true" if value is None else value
        if origins is not None:
            origins.by_path[key] = f"--{key}"
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] | Sequence[tuple[str, str | None]] = (),
) -> T:
    """Load `cls` from an optional YAML file plus command-line overrides.

    Args:
        cls: the root config dataclass.
        path: a YAML file; None starts from the dataclass defaults.
        overrides: raw arguments (`["--optim.lr", "3e-4"]`) or parsed pairs.
    """
    data: dict[str, Any] = {}
    origins = _Origins(str(path) if path else "<defaults>", field_paths(cls))
    if path is not None:
        data, lines = read_yaml(path)
        origins.by_path.update({k: f"{path}:{n}" for k, n in lines.items()})
    pairs = parse_overrides(overrides) if overrides and isinstance(overrides[0], str) else overrides
    for key, _ in pairs:
        _check_override_path(cls, key, origins.root_paths)
    data = apply_overrides(data, pairs, origins)
    return from_dict(cls, data, _origins=origins)


def config_from_args(cls: type[T], argv: Sequence[str]) -> T:
    """Parse `[--config FILE] [--section.field value ...]` into `cls`."""
    argv = list(argv)
    path = None
    for flag in ("--config", "-c"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a file path")
            path = argv[i + 1]
            del argv[i : i + 2]
    eq = [a for a in argv if a.startswith("--config=")]
    if eq:
        path = eq[0].split("=", 1)[1]
        argv.remove(eq[0])
    return load_config(cls, path, argv)
