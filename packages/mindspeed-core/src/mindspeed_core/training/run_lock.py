"""One run per folder: an exclusive lock on a run (or checkpoint) directory.

Two training runs writing into one folder mix their weights and metrics. `RunLock`
holds `flock` on `<folder>/.lock` for the life of a run; the file says who holds it
(pid, host, start time), so a second run refuses at once naming the folder and the
other process. The kernel drops an flock when its holder dies, even by SIGKILL, so a
lock left by a killed run never blocks the next one (its file is simply taken over).

`acquire_run_lock(...)` is the collective form a training loop calls once at start:
rank 0 takes the locks and every rank raises the same error when it cannot.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import torch.distributed as dist

from mindspeed_core.errors import ConfigError
from mindspeed_core.files import check_folder

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive, non-blocking lock on `folder` (created if needed), held until
    `release()` or until this object is garbage collected: keep a reference.

    Args:
        folder: the run directory to own.
        what: how errors name it (e.g. "--logging.run_dir").

    Raises:
        ConfigError: `folder` is a file, or another process holds the lock.
    """

    def __init__(self, folder: str | os.PathLike, what: str = "run directory"):
        self.folder = check_folder(folder, what)
        self.what = what
        self._file = None

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = open(self.folder / LOCK_FILE, "a+")  # noqa: SIM115 - kept open while held
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(handle)
            handle.close()
            raise ConfigError(
                f"{self.what} {self.folder} is in use by {holder}; wait for that run to "
                "finish, stop it, or choose another folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        )
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_run_lock(
    *folders: tuple[str | os.PathLike, str], group: dist.ProcessGroup | None = None
) -> list[RunLock]:
    """Lock each (folder, what) on rank 0 (collective); every rank raises if one is taken.

    Folders that are the same directory are locked once. Returns the held locks (empty
    on other ranks); release them with `release_all` when the run ends.

    Raises:
        ConfigError: on every rank, naming the folder and the process holding it.
    """
    locks: list[RunLock] = []
    error = None
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        seen: set[str] = set()
        try:
            for folder, what in folders:
                key = os.path.realpath(folder)
                if key not in seen:
                    seen.add(key)
                    locks.append(RunLock(folder, what).acquire())
        except ConfigError as err:
            release_all(locks)
            locks, error = [], str(err)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [error]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return locks


def release_all(locks: list[RunLock]) -> None:
    for lock in locks:
        lock.release()


def _describe(handle) -> str:
    """Who holds the lock, from the file it wrote."""
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
        return f"pid {info['pid']} on {info['host']} (started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "another process"
