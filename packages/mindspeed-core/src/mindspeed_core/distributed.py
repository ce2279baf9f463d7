"""Process-group setup from torchrun's environment, and rank helpers.

`init_distributed()` reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT as torchrun sets them, checks that they agree, picks
the backend from the device (gloo, nccl, hccl) and starts the default process
group. A plain `python script.py` with none of them set runs as a world of one
(an in-memory store, no network), so the same code needs no launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mindspeed_core import device as dev
from mindspeed_core.errors import ParallelError

DEFAULT_TIMEOUT = timedelta(minutes=10)
logger = logging.getLogger("mindspeed.distributed")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in the job, as returned by `init_distributed`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ParallelError(f"environment variable {name}={raw!r} is not an integer") from None


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse and check the launcher's environment variables.

    Raises:
        ParallelError: a variable is missing, not an integer or out of range.
    """
    environ = os.environ if environ is None else environ
    rank, world = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
    if rank is None and world is None:
        return LaunchEnv(0, 1, 0, 1, environ.get("MASTER_ADDR"), _int_var(environ, "MASTER_PORT"))
    if rank is None or world is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise ParallelError(
            f"{missing} is not set but {'WORLD_SIZE' if rank is None else 'RANK'} is; "
            "launch with torchrun or set both"
        )
    if world < 1:
        raise ParallelError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise ParallelError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    local_rank = _int_var(environ, "LOCAL_RANK")
    if local_rank is None:
        if world > 1:
            raise ParallelError("LOCAL_RANK is not set; launch with torchrun or set it per process")
        local_rank = 0
    local_world = _int_var(environ, "LOCAL_WORLD_SIZE") or max(local_rank + 1, 1)
    if not 0 <= local_rank < local_world or local_world > world:
        raise ParallelError(
            f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world} and WORLD_SIZE={world} "
            "is inconsistent"
        )
    addr, port = environ.get("MASTER_ADDR"), _int_var(environ, "MASTER_PORT")
    if world > 1 and not addr:
        raise ParallelError(f"MASTER_ADDR is not set but WORLD_SIZE={world}")
    if world > 1 and port is None:
        raise ParallelError(f"MASTER_PORT is not set but WORLD_SIZE={world}")
    if port is not None and not 0 < port < 65536:
        raise ParallelError(f"MASTER_PORT={port} is not a valid port")
    return LaunchEnv(rank, world, local_rank, local_world, addr, port)


def init_distributed(
    *,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
) -> DistributedInfo:
    """Start the default process group for this process and bind it to its device.

    Args:
        device_type: "cpu", "cuda", "npu" or None/"auto" to detect (see `device`).
        backend: overrides the backend chosen from the device type.
        timeout: collective timeout, a timedelta or seconds.

    Returns:
        The rank, world size, local rank, device and backend of this process.

    Raises:
        ParallelError: the launcher's environment is inconsistent, or a process
            group already exists.
    """
    if dist.is_initialized():
        raise ParallelError(
            "the default process group is already initialised; call destroy_distributed() first"
        )
    env = read_launch_env()
    device_type = dev.detect_device_type(device_type)
    device = dev.get_device(env.local_rank, device_type)
    backend = backend or dev.backend_for(device_type)
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if env.world_size == 1 and env.master_addr is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(
            backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout
        )
        _record_peers(env)
        if env.rank == 0 and (warning := elastic_restart_warning()):
            logger.warning(warning)
    return DistributedInfo(env.rank, env.world_size, env.local_rank, device, backend)


def elastic_restart_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """Why torchrun's restarts of this job may fail, or None.

    Under `--max-restarts`, torch >= 2.5 keeps its agent's store (which the workers share)
    across restarts, and restarted workers can read the dead ones' addresses there and fail
    to connect (pytorch/pytorch#135712); an agent started with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each restart a store of its own.
    """
    environ = os.environ if environ is None else environ
    restarts = _int_var(environ, "TORCHELASTIC_MAX_RESTARTS") or 0
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (
            "torchrun --max-restarts with the agent's shared store: a restart may fail to "
            "connect (pytorch/pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "before torchrun"
        )
    return None


def current_distributed(device_type: str | None = None) -> DistributedInfo:
    """The `DistributedInfo` of a process group someone else already started.

    For code that runs both alone (and calls `init_distributed`) and inside a
    caller's job (a test harness, an embedding framework).
    """
    if not dist.is_initialized():
        raise ParallelError("no process group; call init_distributed() first")
    env = read_launch_env()
    device_type = dev.detect_device_type(device_type)
    device = dev.get_device(env.local_rank, device_type)
    return DistributedInfo(
        dist.get_rank(), dist.get_world_size(), env.local_rank, device, dist.get_backend()
    )


def destroy_distributed() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
    # _PEERS stays: an error that ended the job is reported after this teardown.


@contextlib.contextmanager
def process_group(device: str | None = "auto") -> Iterator[DistributedInfo]:
    """This process's `DistributedInfo` for the length of a command: a new process group
    when none exists (torchrun's, or one process alone), destroyed on exit; the caller's
    (a test harness, an embedding framework) when one does, left as it is.

    `device`: "auto" (or None), "cpu", "cuda" or "npu"."""
    owns = not dist.is_initialized()
    device = None if device == "auto" else device
    info = init_distributed(device_type=device) if owns else current_distributed(device)
    try:
        yield info
    finally:
        if owns:
            destroy_distributed()


# -- naming a rank that died ------------------------------------------------------------
# When one rank dies, the others fail in their next collective with the backend's raw
# error ("Connection closed by peer [10.0.0.5]:41234"). `init_distributed` records every
# rank's host, address and pid, so `lost_peer_message` can say which rank it was. This
# is the one piece of module state here: diagnostic data, written once per process group.

_PEERS: list[tuple[int, str, str, int]] = []  # (rank, host, ip, pid)
_LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|remote worker crash|"
    r"remote process exited|Socket Timeout|Connection refused",
    re.IGNORECASE,
)
_PEER_IP = re.compile(r"peer \[([^\]]+)\]")


def _record_peers(env: LaunchEnv) -> None:
    me = (env.rank, socket.gethostname(), _own_ip(env.master_addr, env.master_port), os.getpid())
    table: list = [None] * env.world_size
    dist.all_gather_object(table, me)
    _PEERS[:] = table


def _own_ip(master_addr: str | None, master_port: int | None) -> str:
    """The address this host uses to reach the master (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr or "127.0.0.1", master_port or 1))
            return probe.getsockname()[0]
    except OSError:
        return "?"


def lost_peer_message(error: BaseException) -> str | None:
    """One line naming the rank(s) that died, when `error` is a collective that lost a
    peer; None for any other error."""
    text = " ".join(str(error).split())
    if not isinstance(error, RuntimeError) or not _LOST_PEER.search(text):
        return None
    me = get_rank()
    host = socket.gethostname()
    local = [p for p in _PEERS if p[0] != me and p[1] == host]
    dead = []
    for _ in range(20):  # a killed peer's sockets close a moment before it is gone
        dead = [p for p in local if not _running(p[3])]
        if dead or not local:
            break
        time.sleep(0.1)
    if not dead:  # not on this host: the ranks behind the address the backend names
        match = _PEER_IP.search(text)
        dead = [p for p in _PEERS if p[0] != me and match and p[2] == match.group(1)]
    if dead:
        who = ", ".join(f"rank {r} (pid {pid} on {h})" for r, h, _, pid in dead)
        lost = f"{who} {'has' if len(dead) == 1 else 'have'} died"
    else:
        lost = "another rank has died or become unreachable"
    return f"{lost}; rank {me} stopped in a collective. See that rank's output for the cause."


def _running(pid: int) -> bool:
    """Whether `pid` is a live process on this host (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def get_rank() -> int:
    """Global rank, 0 when no process group exists."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """World size, 1 when no process group exists."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return get_rank() == 0


class _Rank0Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank0() or record.levelno >= logging.WARNING


def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr; ranks other than 0 only pass warnings and errors.

    Messages carry the rank, so a warning from rank 3 says it came from rank 3.
    """
    handler = logging.StreamHandler()
    handler.addFilter(_Rank0Filter())
    handler.setFormatter(
        _RankFormatter("[%(asctime)s rank%(rank)s %(levelname)s] %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("mindspeed")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.rank = get_rank()
        return super().format(record)
