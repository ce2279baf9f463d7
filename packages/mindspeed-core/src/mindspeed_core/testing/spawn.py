"""Run a function on several gloo ranks on CPU and collect what each returns.

Each rank is a fresh `spawn`ed process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
set as torchrun would, MINDSPEED_DEVICE=cpu and OMP_NUM_THREADS=1, and the
default process group already initialised through `init_distributed()`.
The function and its arguments must be picklable (define it at module level).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

_POLL_S = 0.05


class RankFailure(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; all ranks were killed."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_module(name: str, file: str | None) -> None:
    """Make module `name` importable in this fresh process.

    pytest's importlib mode names test modules after their path
    ("packages.mindspeed-core.tests.test_x"), which no child can import; load the
    file under that name so the pickled function and arguments resolve.
    """
    if name in sys.modules or name == "__main__" or file is None:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


class _Unpickler(pickle.Unpickler):
    """Resolves classes from sys.modules first (see `_ensure_module`)."""

    def find_class(self, module: str, name: str):
        if module in sys.modules:
            obj = sys.modules[module]
            for part in name.split("."):
                obj = getattr(obj, part)
            return obj
        return super().find_class(module, name)


def _rank_main(module_name, module_file, payload, results) -> None:
    import torch

    from mindspeed_core.distributed import destroy_distributed, init_distributed

    rank = int(os.environ["RANK"])
    if hasattr(os, "setpgid"):  # its own process group: `_kill` takes its helpers along
        os.setpgid(0, 0)
    try:
        _ensure_module(module_name, module_file)
        fn, args, kwargs = _Unpickler(io.BytesIO(payload)).load()
        torch.set_num_threads(1)
        init_distributed(device_type="cpu", timeout=float(os.environ["_MINDSPEED_PG_TIMEOUT"]))
        value = fn(*args, **kwargs)
        # Plain pickle copies tensor data; torch's queue pickler would share it through
        # file descriptors that vanish when this process exits first.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


@contextmanager
def _environment(updates: dict[str, str]):
    """Set variables for children started inside the block, then restore ours."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_ranks(fn, world_size, args, kwargs, results, timeout, ctx) -> list:
    port = str(free_port())
    module = sys.modules.get(fn.__module__)
    target_args = (
        fn.__module__,
        getattr(module, "__file__", None),
        pickle.dumps((fn, args, kwargs)),
        results,
    )
    procs = []
    for rank in range(world_size):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "MINDSPEED_DEVICE": "cpu",
            "_MINDSPEED_PG_TIMEOUT": str(max(timeout, 1.0)),
        }
        with _environment(env):
            # Not daemonic, so a rank may start its own workers (DataLoader); we kill them ourselves.
            proc = ctx.Process(target=_rank_main, args=target_args, daemon=False)
            proc.start()
        procs.append(proc)
    return procs


def _kill(procs) -> None:
    """Kill every rank and what it started (a rank leads its own process group: a
    library's helper process, e.g. a multiprocessing Manager, would otherwise outlive
    the rank that is killed before its exit handlers run)."""
    for p in procs:
        if p.pid is not None and hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` CPU ranks; return each rank's result.

    Raises:
        RankFailure: a rank raised (or died); carries its traceback. All ranks
            are killed, since the others may wait forever in a collective.
        RankTimeout: not every rank finished within `timeout` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = _start_ranks(fn, world_size, args, kwargs, results, timeout, ctx)
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                _check_alive(procs, outputs)
                if time.monotonic() > deadline:
                    pending = sorted(set(range(world_size)) - set(outputs))
                    raise RankTimeout(
                        f"ranks {pending} of {world_size} did not finish within "
                        f"{timeout:g} s; all ranks were killed"
                    ) from None
                continue
            if not ok:
                raise RankFailure(rank, value)
            outputs[rank] = _Unpickler(io.BytesIO(value)).load()
    finally:
        _kill(procs)
        results.close()
    return [outputs[r] for r in range(world_size)]


def _check_alive(procs, outputs) -> None:
    for rank, p in enumerate(procs):
        # A rank that exits non-zero without reporting (segfault, os._exit) never puts a result.
        if rank not in outputs and p.exitcode not in (None, 0):
            raise RankFailure(rank, f"process exited with code {p.exitcode} without a result")
