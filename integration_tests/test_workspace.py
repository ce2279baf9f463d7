"""The workspace holds six packages released together under one version."""

import importlib
from pathlib import Path

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
