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


ROLES = ("trainer", "objective")
"""Objects that are built whole: a method gives them their parts through `Objective.setup`,
`Objective.build_step` and `Trainer(...)`'s arguments, never by assignment afterwards."""


def _role(node: ast.expr) -> str | None:
    """`trainer` / `objective` / `x.trainer` / `self.objective`: the role `node` names."""
    if isinstance(node, ast.Name) and node.id in ROLES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in ROLES:
        return ast.unparse(node)
    return None


def _assignments_into_roles(path: Path) -> list[str]:
    """`trainer.x = ...`, `objective.x, y = ...`, `trainer.x += ...`, `setattr(trainer, ...)`."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and node.args and _role(node.args[0])):  # fmt: skip
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        found += [f"{path}:{node.lineno}: {ast.unparse(t)} = ..." for t in flat
                  if isinstance(t, ast.Attribute) and _role(t.value)]  # fmt: skip
    return found


def test_nothing_is_assigned_into_a_built_trainer_or_objective():
    files = [p for src in ("packages", "benchmarks") for p in sorted((ROOT / src).rglob("*.py"))
             if "/tests/" not in str(p)]  # fmt: skip
    found = [f for p in files for f in _assignments_into_roles(p.relative_to(ROOT))]
    assert not found, "assignments into a built trainer or objective:\n" + "\n".join(found)


def test_the_assignment_walk_finds_what_it_looks_for(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "trainer.step = step\n"
        "objective.reference, objective.ctx = ref, ctx\n"
        "self.objective.mismatch = None\n"
        "setattr(trainer, 'x', 1)\n"
        "self.step = step\n"  # inside its own class: fine
        "trainer.state.step += 1\n"  # a counter object's own field: fine
    )
    found = [line.split(": ", 1)[1] for line in _assignments_into_roles(planted)]
    assert found == [
        "trainer.step = ...",
        "objective.reference = ...",
        "objective.ctx = ...",
        "self.objective.mismatch = ...",
        "setattr(trainer, 'x', 1)",
    ]
