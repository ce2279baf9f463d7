"""mindspeed-core and mindspeed-ops each install and work alone, from their wheels.

Builds the wheels, makes a fresh virtual environment per package and installs
only that wheel, then runs it there. Third-party dependencies are pinned to the
workspace lock, so uv reuses the wheels `uv sync` already cached and asks the
registry only for metadata.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UV = os.environ.get("UV") or shutil.which("uv")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(UV is None, reason="needs uv")]


def sh(*args, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=900, cwd=ROOT, **kwargs
    )
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    for name in ("mindspeed-core", "mindspeed-ops"):
        sh(UV, "build", "--offline", "--package", name, "--wheel", "--out-dir", out)
    pins = out / "constraints.txt"
    exported = sh(
        UV, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--all-extras", "--no-dev"
    ).stdout
    pins.write_text(
        "\n".join(
            line
            for line in exported.splitlines()
            if line and not line.startswith(("#", "-e", "./", "torch-npu"))
        )
    )
    return out


def fresh_venv_with(wheels: Path, tmp_path: Path, dist_name: str) -> Path:
    venv = tmp_path / "venv"
    sh(UV, "venv", "--python", sys.executable, venv)
    wheel = next(wheels.glob(dist_name.replace("-", "_") + "-*.whl"))
    sh(
        UV,
        "pip",
        "install",
        "--python",
        venv / "bin" / "python",
        "--constraint",
        wheels / "constraints.txt",
        wheel,
    )
    return venv


def test_core_installs_and_runs_alone(wheels, tmp_path):
    venv = fresh_venv_with(wheels, tmp_path, "mindspeed-core")
    env = {**os.environ, "MINDSPEED_DEVICE": "cpu", "VIRTUAL_ENV": str(venv)}
    version = sh(venv / "bin" / "mindspeed", "--version", env=env).stdout.strip()
    assert version == "mindspeed 0.1.0"
    info = json.loads(sh(venv / "bin" / "mindspeed", "env", "--json", env=env).stdout)
    assert info["packages"] == {"mindspeed-core": "0.1.0"}
    assert info["backend"] == "gloo"
    # none of the other packages came along
    listed = sh(UV, "pip", "list", "--python", venv / "bin" / "python").stdout
    assert "mindspeed-ops" not in listed and "mindspeed-llm" not in listed


def test_ops_installs_and_imports_alone(wheels, tmp_path):
    venv = fresh_venv_with(wheels, tmp_path, "mindspeed-ops")
    out = sh(
        venv / "bin" / "python",
        "-c",
        "import importlib.util, mindspeed_ops; "
        "print(mindspeed_ops.__version__, importlib.util.find_spec('mindspeed_core') is None)",
    )
    assert out.stdout.split() == ["0.1.0", "True"]
    assert not (venv / "bin" / "mindspeed").exists()  # the CLI belongs to core
