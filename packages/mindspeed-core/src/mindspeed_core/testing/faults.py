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

__all__ = ["check_full_disk_resumes", "disk_full_after"]


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


def check_full_disk_resumes(main, args: list[str], run_dir: Path, capsys, steps: int) -> None:
    """A command run (`guarded(main, args)`, checkpoints every 2 steps) whose second save
    finds the disk full: one line "error: no space left on device for ...", no traceback,
    exit 2, step 2 kept; with room again the rerun resumes and logs every one of `steps`."""
    from mindspeed_core.cli import guarded
    from mindspeed_core.training import read_metrics

    capsys.readouterr()
    with disk_full_after(saves=1):
        assert guarded(main, args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: no space left on device for"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_2"]
    assert guarded(main, args) == 0  # room again: resumes from step 2
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
