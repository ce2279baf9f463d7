"""Injected faults for tests of commands that save checkpoints.

`disk_full_after(saves)`: checkpoint saves after the first `saves` fail as on a full file
system: a synchronous save as torch's zip writer reports it (a partial shard, then a bare
"unexpected pos" RuntimeError, no OSError), an asynchronous one with ENOSPC from its writer;
the file system then reports no free space. Leaving the block gives the room back.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

__all__ = ["disk_full_after"]


@contextmanager
def disk_full_after(saves: int) -> Iterator[list[str]]:
    """Yields the checkpoint folders the saves were asked to write, in order."""
    from mindspeed_core.checkpoint import manager

    real_save, real_async, real_usage = manager.dcp.save, manager.dcp.async_save, shutil.disk_usage
    calls: list[str] = []

    def full() -> bool:
        return len(calls) > saves

    def save(state, *, checkpoint_id, **kwargs):
        calls.append(str(checkpoint_id))
        if not full():
            return real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def async_save(state, *, checkpoint_id, **kwargs):
        calls.append(str(checkpoint_id))
        if not full():
            return real_async(state, checkpoint_id=checkpoint_id, **kwargs)
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        failed: Future = Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return failed

    def usage(path):
        measured = real_usage(path)
        return measured._replace(free=0) if full() else measured

    with mock.patch.object(manager.dcp, "save", save), \
            mock.patch.object(manager.dcp, "async_save", async_save), \
            mock.patch.object(manager.shutil, "disk_usage", usage):  # fmt: skip
        yield calls
