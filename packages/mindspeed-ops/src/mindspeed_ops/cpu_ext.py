"""The C++ CPU kernels: built on first use with torch.utils.cpp_extension, cached on disk.

The build lands in `$MINDSPEED_OPS_CACHE` or `~/.cache/mindspeed_ops/<torch version>/<isa>`,
so a new torch or a different instruction set gets its own build. The instruction set is the
one torch itself dispatches to on this machine (AVX2 where torch reports AVX2 or AVX512,
plain x86-64/aarch64 code otherwise); we never pass -march=native. A file lock makes ranks
that start together build once and share the result. Without a compiler, or when the build
fails, `load()` returns None and warns once; callers then run the PyTorch reference.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

CACHE_ENV_VAR = "MINDSPEED_OPS_CACHE"
DISABLE_ENV_VAR = "MINDSPEED_OPS_NO_CPP"  # "1": never build, always the reference
_NAME = "mindspeed_ops_cpu"
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("fused_ops.cpp", "skinny_linear.cpp", "flash_attention.cpp")
]

_state: dict[str, object] = {"loaded": False, "module": None, "why": "not built yet"}


def _isa() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine() in ("x86_64", "AMD64") and capability in ("AVX2", "AVX512"):
        return "avx2"
    return "default"


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    if _isa() == "avx2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return flags


def build_dir() -> Path:
    """Where the extension is (or will be) built for this torch and instruction set."""
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root) if root else Path.home() / ".cache" / "mindspeed_ops"
    version = torch.__version__.replace("+", "_")
    # The compile command names torch's headers, the sources and the compiler: two
    # environments (a checkout's venv, an installed wheel) would each rebuild over the
    # other's objects on every first use, so each gets its own folder.
    command = "\0".join(
        [str(Path(torch.__file__).parent), *map(str, _SOURCES), *_flags(), str(compiler())]
    )
    digest = hashlib.sha256(command.encode()).hexdigest()[:10]
    return base / version / f"{platform.machine()}-{_isa()}-{digest}"


def compiler() -> str | None:
    """Path of the C++ compiler cpp_extension would call, or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _NoCudaRuntimeNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." notice: it comes from
    torch.utils.cpp_extension probing for CUDA at import, which a CPU-only build never uses."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def _cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension, imported without its CUDA probe's notice on a CPU machine
    (every other message of that logger still gets through)."""
    probe_logger = logging.getLogger("torch.utils.cpp_extension")
    notice = _NoCudaRuntimeNotice()
    probe_logger.addFilter(notice)
    try:
        from torch.utils import cpp_extension
    finally:
        probe_logger.removeFilter(notice)
    return cpp_extension


def _build() -> ModuleType:
    cpp_extension = _cpp_extension()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(directory / "build.lock"):
        return cpp_extension.load(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C++ kernels can be had (`load`, building them on the first call). A
    constant to torch.compile, which calls it once instead of tracing the build's file
    checks (a compiled block that picks a kernel would otherwise break its graph there)."""
    return load() is not None


def load() -> ModuleType | None:
    """The compiled kernels, building them on the first call; None if they cannot be had."""
    if _state["loaded"]:
        return _state["module"]  # type: ignore[return-value]
    _state["loaded"] = True
    if os.environ.get(DISABLE_ENV_VAR) == "1":
        _state["why"] = f"disabled by {DISABLE_ENV_VAR}=1"
    elif compiler() is None:
        _state["why"] = "no C++ compiler found (set CXX or install g++)"
    else:
        try:
            _state["module"] = _build()
            _state["why"] = "built"
        except Exception as e:  # any build failure degrades to the reference
            _state["why"] = f"build failed: {e.__class__.__name__}: {str(e)[:300]}"
    if _state["module"] is None:
        warnings.warn(
            f"mindspeed_ops: C++ CPU kernels unavailable ({_state['why']}); "
            "using the PyTorch reference on CPU",
            RuntimeWarning,
            stacklevel=3,
        )
    return _state["module"]  # type: ignore[return-value]


def status() -> str:
    """'built' or 'not built: <why>', without triggering a build."""
    if _state["module"] is not None:
        return "built"
    if _state["loaded"]:
        return f"not built: {_state['why']}"
    if os.environ.get(DISABLE_ENV_VAR) == "1":
        return f"not built: disabled by {DISABLE_ENV_VAR}=1"
    if compiler() is None:
        return "not built: no C++ compiler found"
    if any(build_dir().glob(f"{_NAME}*.so")):
        return f"built (cached in {build_dir()}, loads on first use)"
    return "not built yet (builds on first CPU use)"


if __name__ == "__main__":
    # Ahead-of-time build (e.g. in a container image): python -m mindspeed_ops.cpu_ext
    load()
    print(f"{status()} ({build_dir()})")
    raise SystemExit(0 if _state["module"] is not None else 1)
