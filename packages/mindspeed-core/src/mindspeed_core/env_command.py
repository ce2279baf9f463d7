"""`mindspeed env`: what a user pastes into a bug report.

Other packages may add lines through the entry-point group `mindspeed.env`:
each entry point names a function returning a dict of label -> text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
from importlib.metadata import distributions, entry_points

from mindspeed_core.cli import Command

ENV_GROUP = "mindspeed.env"


def mindspeed_packages() -> dict[str, str]:
    """Installed MindSpeed distributions and their versions."""
    found = {}
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mindspeed-") and name != "mindspeed-workspace":
            found[name] = dist.version
    return dict(sorted(found.items()))


def cxx_compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension would use, with its version, or None."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        first = out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        first = ""
    return f"{path} ({first})" if first else path


def collect() -> dict[str, object]:
    """Everything `mindspeed env` reports, as plain data."""
    import torch

    from mindspeed_core import device as dev

    device_type = dev.detect_device_type()
    info: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "device": device_type,
        "backend": dev.backend_for(device_type),
        "device_count": dev.device_count(device_type),
        "device_name": dev.device_name(device_type),
        "device_override": os.environ.get(dev.DEVICE_ENV_VAR) or None,
        "cuda_available": dev.cuda_available(),
        "npu_available": dev.npu_available(),
        "cxx_compiler": cxx_compiler(),
        "packages": mindspeed_packages(),
    }
    for ep in entry_points(group=ENV_GROUP):
        try:
            info.update(ep.load()())
        except Exception as e:  # report, never fail the bug-report command
            info[f"{ep.name}_error"] = f"{e.__class__.__name__}: {e}"
    return info


def _format(info: dict[str, object]) -> str:
    lines = []
    for key, value in info.items():
        if key == "packages":
            value = ", ".join(f"{n} {v}" for n, v in value.items()) or "none"
        elif value is None:
            value = "-"
        lines.append(f"{key:<18} {value}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mindspeed env", description=HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info) if args.json else _format(info))
    return 0


HELP = "print versions, the detected device and backend, and installed MindSpeed packages"
command = Command(help=HELP, run=run)
