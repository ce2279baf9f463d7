import enum
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mindspeed_core.config import (
    config_from_args,
    dump_yaml,
    field_paths,
    from_dict,
    load_config,
    parse_overrides,
    read_yaml,
    to_dict,
)
from mindspeed_core.errors import ConfigError

APP = Path(__file__).with_name("config_app.py")
_spec = importlib.util.spec_from_file_location("core_config_app", APP)
_app = importlib.util.module_from_spec(_spec)
sys.modules["core_config_app"] = _app  # dataclasses look their module up by name
_spec.loader.exec_module(_app)
AppConfig, OptimConfig, Precision = _app.AppConfig, _app.OptimConfig, _app.Precision


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_overrides_convert_types(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 3e-4\ntrain:\n  steps: 5\n  precision: bf16\n")
    cfg = config_from_args(
        AppConfig,
        [
            "--config",
            str(path),
            "--parallel.tp",
            "2",
            "--train.compile",
            "--optim.betas=[0.8, 0.9]",
            "--train.data_paths",
            "a.bin,b.bin",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string; we convert
    assert cfg.train.steps == 5 and cfg.train.precision is Precision.BF16
    assert cfg.parallel.tp == 2 and cfg.parallel.dp_shard == -1
    assert cfg.train.compile is True
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.data_paths == ["a.bin", "b.bin"]


def test_override_beats_file_and_negative_numbers_are_values(tmp_path):
    path = write(tmp_path, "parallel:\n  tp: 4\n")
    cfg = load_config(AppConfig, path, ["--parallel.tp", "2", "--parallel.dp_shard", "-1"])
    assert cfg.parallel.tp == 2 and cfg.parallel.dp_shard == -1


def test_dump_and_reload_give_the_same_object(tmp_path):
    cfg = load_config(
        AppConfig,
        None,
        ["--train.precision", "BF16", "--optim.lr", "0.5", "--train.data_paths", "[x, y]"],
    )
    out = tmp_path / "resolved.yaml"
    dump_yaml(cfg, out)
    assert load_config(AppConfig, out) == cfg
    assert from_dict(AppConfig, to_dict(cfg)) == cfg


def test_unknown_key_suggests_nearest(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1.0\n  weight_decy: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=r"run.yaml:3: unknown key 'optim.weight_decy'; "
        r"did you mean 'optim.weight_decay'\?",
    ):
        load_config(AppConfig, path)
    # a key in the wrong section is matched against the whole tree
    with pytest.raises(
        ConfigError, match=r"--train.lr: unknown key 'train.lr'; did you mean 'optim.lr'"
    ):
        load_config(AppConfig, None, ["--train.lr", "1"])
    with pytest.raises(ConfigError, match=r"unknown key 'optimm'; did you mean"):
        load_config(AppConfig, None, ["--optimm.lr", "1"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel.tp", "two"], r"--parallel.tp: parallel.tp: expected an integer, got 'two'"),
        (["--parallel.tp", "2.5"], r"expected an integer, got '2.5'"),
        (["--train.compile", "maybe"], r"train.compile: expected true or false, got 'maybe'"),
        (["--train.precision", "fp8"], r"train.precision: expected one of \['fp32', 'bf16'\]"),
        (["--optim.betas", "[1, 2, 3]"], r"optim.betas: expected a list of 2 items"),
        (["--optim.lr"], r"optim.lr: expected a number, got 'true'"),
        (["--parallel.tp", "0"], r"--parallel.tp: parallel: tp must be at least 1, got 0"),
        (["stray"], r"unexpected argument 'stray'"),
        (["--optim.lr.x", "1"], r"'optim.lr' is a value, not a section"),
    ],
)
def test_bad_overrides(args, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(AppConfig, args)


def test_yaml_errors_name_file_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*missing.yaml"):
        read_yaml(tmp_path / "missing.yaml")
    bad = write(tmp_path, "optim:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"run.yaml:3:1: malformed YAML"):
        read_yaml(bad)
    dup = write(tmp_path, "optim:\n  lr: 1\n  lr: 2\n", "dup.yaml")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: key 'optim.lr' appears twice"):
        read_yaml(dup)
    scalar = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"list.yaml: the top level must be a mapping"):
        read_yaml(scalar)
    wrong = write(tmp_path, "optim: 3\n", "wrong.yaml")
    with pytest.raises(ConfigError, match=r"wrong.yaml:1: optim must be a mapping, got 3"):
        load_config(AppConfig, wrong)
    typed = write(tmp_path, "train:\n  steps: ten\n", "typed.yaml")
    with pytest.raises(ConfigError, match=r"typed.yaml:2: train.steps: expected an integer"):
        load_config(AppConfig, typed)


class Color(enum.Enum):
    RED = 1


@dataclass(kw_only=True)
class Inner:
    name: str
    mode: Literal["a", "b"] = "a"
    path: Path | None = None


@dataclass(kw_only=True)
class Outer:
    inner: Inner
    maybe: int | None = None
    weights: dict[str, float] = field(default_factory=dict)
    color: Color = Color.RED


def test_required_optional_literal_dict_and_enum():
    with pytest.raises(ConfigError, match=r"missing required field 'inner.name'"):
        from_dict(Outer, {"inner": {}})
    cfg = from_dict(
        Outer,
        {
            "inner": {"name": 7, "mode": "b", "path": "x/y"},
            "maybe": "null",
            "weights": {"a": 1},
            "color": "red",
        },
    )
    assert cfg.inner == Inner(name="7", mode="b", path=Path("x/y"))
    assert cfg.maybe is None and cfg.weights == {"a": 1.0} and cfg.color is Color.RED
    with pytest.raises(ConfigError, match=r"inner.mode: expected one of \['a', 'b'\]"):
        from_dict(Outer, {"inner": {"name": "n", "mode": "c"}})
    with pytest.raises(ConfigError, match=r"maybe: expected an integer"):
        from_dict(Outer, {"inner": {"name": "n"}, "maybe": "x"})
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_field_paths_and_parse_overrides():
    assert "optim.lr" in field_paths(AppConfig) and "train.precision" in field_paths(AppConfig)
    assert parse_overrides(["--a.b", "1", "--c=2", "--flag"]) == [
        ("a.b", "1"),
        ("c", "2"),
        ("flag", None),
    ]
    assert OptimConfig().betas == (0.9, 0.95)


# ---- what a user sees from a command: one line, exit status 2, no traceback


def run_app(*args, env=None):
    return subprocess.run(
        [sys.executable, str(APP), *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize(
    ("yaml_text", "args", "expected"),
    [
        ("optim:\n  lrr: 1\n", [], "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("", ["--parallel.tp", "x"], "--parallel.tp: parallel.tp: expected an integer, got 'x'"),
        (None, [], "config file not found:"),
        ("optim: {lr: 1\n", [], "malformed YAML"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, yaml_text, args, expected):
    path = tmp_path / "cfg.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    proc = run_app("--config", str(path), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_debug_shows_traceback(tmp_path):
    proc = run_app("--optim.lrr", "1", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_cli_good_input_prints_resolved_config(tmp_path):
    proc = run_app("--optim.lr", "0.25")
    assert proc.returncode == 0, proc.stderr
    path = write(tmp_path, proc.stdout)
    assert load_config(AppConfig, path).optim.lr == 0.25


def test_a_section_given_in_part_keeps_its_owners_defaults():
    """A config whose section default differs from the section class's own defaults
    (e.g. SFT's `train.steps=400`) keeps it when another field of that section is set."""
    from dataclasses import dataclass, field

    from mindspeed_core.config import load_config

    @dataclass(kw_only=True)
    class Section:
        steps: int = 100
        batch: int = 1

    @dataclass(kw_only=True)
    class Owner:
        train: Section = field(default_factory=lambda: Section(steps=400))

    cfg = load_config(Owner, None, ["--train.batch=4"])
    assert (cfg.train.steps, cfg.train.batch) == (400, 4)
