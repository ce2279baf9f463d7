"""Recipes: a config per published model and job, with a layout for a stated cluster.

Each `<model>-<job>.yaml` here is a config file of its command (`mindspeed pretrain --config
FILE`); its leading comment lines are a YAML header that says what it is for:

    # recipe: llama3.1-8b-pretrain
    # command: pretrain              the `mindspeed` command whose config it is
    # model: Llama-3.1-8B
    # devices: 8                     processes in all (nodes x devices per node)
    # nodes: 1
    # memory_gb: 64                  memory per device the layout is meant for
    # predicted_peak_gib: 36.4       `mindspeed plan`'s memory estimate per device
    # layout_source: ...             where the layout comes from
    # fill_in: data.paths, ...       what the user must set

`mindspeed recipes` lists them, `mindspeed recipes NAME` prints one (to copy and fill in),
`mindspeed plan --config FILE` and `mindspeed preflight FILE` check one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from mindspeed_core.errors import ConfigError
from mindspeed_core.files import read_text

__all__ = ["RECIPES_DIR", "Recipe", "find_recipe", "read_header", "recipes"]

RECIPES_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    command: str
    model: str
    devices: int
    nodes: int
    memory_gb: float
    predicted_peak_gib: float
    layout_source: str
    fill_in: str


def read_header(path: Path) -> dict:
    """The YAML of the file's leading `# key: value` comment lines, up to the first line
    that is not a comment or is a bare `#` ({} when none)."""
    lines = []
    for line in read_text(path, "config file", error=ConfigError).splitlines():
        if not line.startswith("#") or line.strip() == "#":
            break
        lines.append(line[1:].strip())
    try:
        header = yaml.safe_load("\n".join(lines)) if lines else {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: the recipe header is not YAML: {err}") from None
    return header if isinstance(header, dict) else {}


def _recipe(path: Path) -> Recipe:
    h = read_header(path)
    fields = ("command", "model", "devices", "nodes", "memory_gb", "predicted_peak_gib",
              "layout_source", "fill_in")  # fmt: skip
    missing = [f for f in fields if f not in h]
    if missing or h.get("recipe") != path.stem:
        raise ConfigError(f"{path}: the recipe header lacks {missing or ['recipe: ' + path.stem]}")
    return Recipe(name=path.stem, path=path, **{f: h[f] for f in fields})


def recipes() -> list[Recipe]:
    """Every shipped recipe, by name."""
    return [_recipe(p) for p in sorted(RECIPES_DIR.glob("*.yaml"))]


def find_recipe(name: str) -> Path:
    """The shipped recipe `name` (with or without `.yaml`)."""
    path = RECIPES_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        known = ", ".join(r.stem for r in sorted(RECIPES_DIR.glob("*.yaml")))
        raise ConfigError(f"no recipe named {name!r}; the recipes are: {known}")
    return path
