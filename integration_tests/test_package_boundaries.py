"""Packages talk through public names: no module imports another package's `_private` name
or module, or reaches into one as `module._name` (R2: the seams between packages are
documented functions, not private overrides). Walks the AST of every source file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {p.name for p in (ROOT / "packages").glob("*/src/mindspeed_*")}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _crossings(path: Path, own: str) -> list[str]:
    found, foreign_modules = [], {}
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top not in PACKAGES or top == own:
                continue
            for alias in node.names:
                if _private(node.module) or _private(alias.name):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
                foreign_modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in PACKAGES and top != own:
                    if _private(alias.name):
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
                    foreign_modules[alias.asname or top] = alias.name
    for node in ast.walk(tree):  # module._name, where module is another package's
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in foreign_modules and _private(node.attr)):  # fmt: skip
            found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_package_line():
    found = []
    for src in sorted((ROOT / "packages").glob("*/src/mindspeed_*")):
        for path in sorted(src.rglob("*.py")):
            found += _crossings(path.relative_to(ROOT), src.name)
    assert not found, "private names used across packages:\n" + "\n".join(found)


def test_the_walk_finds_what_it_looks_for(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from mindspeed_llm.demo import _hidden\n"
        "from mindspeed_llm.models import hf_io\n"
        "import mindspeed_llm._internal as inner\n"
        "x = hf_io._layer_of('a')\n"
    )
    found = _crossings(planted, "mindspeed_tools")
    assert [line.split(": ", 1)[1] for line in found] == [
        "from mindspeed_llm.demo import _hidden",
        "import mindspeed_llm._internal",
        "hf_io._layer_of",
    ]
    assert _crossings(planted, "mindspeed_llm") == []  # a package's own private names are its own


def test_models_never_import_peft():
    """Inside mindspeed-llm the arrow runs one way: `peft` builds on `models`, and no module
    of `models` imports `peft` (not even inside a function)."""
    models = ROOT / "packages/mindspeed-llm/src/mindspeed_llm/models"
    found = []
    for path in sorted(models.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])  # fmt: skip
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n.startswith("mindspeed_llm.peft")]  # fmt: skip
    assert not found, "models imports peft:\n" + "\n".join(found)
