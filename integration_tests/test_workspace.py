"""The workspace holds six packages released together under one version; core knows no
model, imports run one way, and core and ops detect devices alike."""

import ast
import importlib
import importlib.machinery
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["core", "ops", "llm", "align", "tools", "eval"]


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_all_packages_share_one_version():
    root_version = _pyproject(ROOT / "pyproject.toml")["project"]["version"]
    for name in PACKAGES:
        project = _pyproject(ROOT / "packages" / f"mindspeed-{name}" / "pyproject.toml")["project"]
        assert project["name"] == f"mindspeed-{name}"
        assert project["version"] == root_version, name
        module = importlib.import_module(f"mindspeed_{name}")
        assert module.__version__ == root_version, name
        # in-workspace dependencies pin the same version, so releases move together
        for dep in project.get("dependencies", []):
            if dep.startswith("mindspeed-"):
                assert dep.endswith(f"=={root_version}"), (name, dep)


def test_each_package_has_src_tests_and_readme():
    for name in PACKAGES:
        pkg = ROOT / "packages" / f"mindspeed-{name}"
        assert (pkg / "src" / f"mindspeed_{name}" / "__init__.py").is_file()
        assert (pkg / "tests").is_dir() and (pkg / "README.md").is_file()


def test_core_and_ops_import_nothing_of_ours():
    for name in ("core", "ops"):
        src = ROOT / "packages" / f"mindspeed-{name}" / "src"
        others = [f"mindspeed_{o}" for o in PACKAGES if o != name]
        for path in src.rglob("*.py"):
            text = path.read_text()
            for other in others:
                assert f"import {other}" not in text and f"from {other}" not in text, (path, other)


# -- what core knows, and which way imports run -------------------------------------------

FAMILY_WORDS = re.compile(r"llama|qwen|mistral|mixtral|deepseek|gemma|phi-?\d|internlm", re.I)
# A decoder's submodule names. Core may use them only as documented parameter defaults
# (e.g. pipeline's `first=("tok_embeddings",)`), never build a model's plan from them.
SUBMODULE_NAMES = {"tok_embeddings", "attention", "attention_norm", "feed_forward", "ffn_norm"}
SUBMODULE_NAMES |= {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "norm", "output", "layers"}


def _defaults(tree: ast.AST) -> set[int]:
    """ids of the constants that are parameter defaults (or inside one)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                found |= {id(n) for n in ast.walk(default)} if default is not None else set()
    return found


def test_core_names_no_model():
    """No model family in core's source (code, comments or docstrings), and a decoder's
    submodule names only as parameter defaults a caller can override."""
    for path in (ROOT / "packages" / "mindspeed-core" / "src").rglob("*.py"):
        text = path.read_text()
        assert not FAMILY_WORDS.search(text), (path, FAMILY_WORDS.search(text).group())
        tree = ast.parse(text)
        allowed = _defaults(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = set(node.value.replace("*", "").split("."))
                assert id(node) in allowed or not parts & SUBMODULE_NAMES, (
                    path,
                    node.lineno,
                    node.value,
                )


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of ours an import statement names (a submodule when it names one)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".")[: len(module.split(".")) - (not is_package)]
            base = ".".join(package[: len(package) - node.level + 1] + [base] * bool(base))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return set()
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        found |= {name} - {"", module}
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (never imported at run time)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for child in node.body
        for n in ast.walk(child)
    }
    return (n for n in ast.walk(tree) if id(n) not in skip)


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> modules of the same package it imports, at module level or in a function."""
    src = ROOT / "packages" / f"mindspeed-{package}" / "src"
    paths = {_module_name(src, p): p for p in (src / f"mindspeed_{package}").rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        graph[module] = set().union(
            *(_imports(n, module, is_package, set(paths)) for n in _runtime_nodes(tree))
        )
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_import_graph_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph("llm")
    assert "mindspeed_llm.models.hf_io" in graph["mindspeed_llm.models.checkpoint_io"]
    assert "mindspeed_llm.models.config" in graph["mindspeed_llm.models.hf_io"]


def test_no_package_has_an_import_cycle():
    """Imports inside functions count too: they hide a cycle, they do not break it."""
    for package in PACKAGES:
        assert _cycle(import_graph(package)) is None, package


# -- device detection: ops repeats core's (it imports nothing of ours) --------------------


class _FakeNpu:
    def __init__(self, available: bool, count: int):
        self._available, self._count = available, count

    def is_available(self) -> bool:
        return self._available

    def device_count(self) -> int:
        return self._count


@pytest.mark.parametrize(
    ("installed", "available", "count"),
    [(False, True, 1), (True, False, 0), (True, True, 0), (True, True, 2)],
)
def test_core_and_ops_detect_devices_alike(monkeypatch, installed, available, count):
    """npu_available and cuda_available agree for every combination of installed,
    available and counted devices (faked: this machine may have none)."""
    import torch

    from mindspeed_core import device as core
    from mindspeed_ops import backends as ops

    if installed:
        fake = types.ModuleType("torch_npu")
        fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
    else:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(torch, "npu", _FakeNpu(available, count), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for module in (core, ops):
        module.npu_available.cache_clear()
    try:
        expected = installed and available and count > 0
        assert core.npu_available() == ops.npu_available() == expected
        assert core.cuda_available() == ops.cuda_available() == (available and count > 0)
    finally:
        for module in (core, ops):
            module.npu_available.cache_clear()
