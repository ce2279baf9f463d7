"""`CheckpointManager`: save and load training state with DCP, atomically and verified.

Layout of `folder`::

    step_200/            a complete DCP checkpoint (.metadata, shard files, checksums.json)
    step_300/
    latest               text: "step_300"
    .tmp_step_400/       a save in progress (or one that crashed); never loaded
    .trash_step_100/     a checkpoint being deleted (keep_last); never loaded

A save writes into ``.tmp_step_<N>``; once every rank's files and `.metadata` are on
disk the ranks hash them into `checksums.json`, and rank 0 renames the folder to
``step_<N>`` and only then replaces ``latest`` (write-then-rename, atomic on POSIX).
Nothing complete is deleted before its replacement is complete: an older checkpoint at
the same step is moved aside only once the new one is whole, and pruning renames a
folder to ``.trash_step_<N>`` before deleting it. A crash at any point leaves ``latest``
on a complete checkpoint (or missing, see below); the next save removes what a crash
left behind.

Loading checks `.metadata` and every record it reads against the checksums, so a
flipped byte is refused naming the shard.
When ``latest`` is missing, garbled or names a folder that is gone, the newest
``step_<N>`` that verifies is used (with a warning); a step the states already hold
(just loaded or saved) is never written again. DCP stores each tensor by name with
its global shape, so a checkpoint saved under one layout loads into any other, and it
is read through `SafeFileSystemReader`, which runs no code from the files.

States are `Stateful` objects (model, optimizer, scheduler, train state, data
position, ...). One marked ``per_rank = True`` (like `RNGState`) is keyed by rank;
a rank with no saved state keeps its current state.

Fault injection (tests only): with ``MINDSPEED_TEST_CRASH_AT=<point>`` or
``<point>@<step>`` the process SIGKILLs itself at that point of a save; the points
are listed in `CRASH_POINTS`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from mindspeed_core.checkpoint.integrity import (
    CHECKSUMS_FILE,
    read_checksums,
    verify_checksums,
    write_checksums,
)
from mindspeed_core.checkpoint.steps import LATEST, parse_step
from mindspeed_core.checkpoint.storage import load_dcp, raise_user_error
from mindspeed_core.checkpoint.verify import check_files, check_states, read_metadata
from mindspeed_core.errors import CheckpointError, disk_full_error, is_disk_full
from mindspeed_core.files import check_folder, fsync_dir, write_file_atomically

logger = logging.getLogger("mindspeed.checkpoint")
CRASH_ENV = "MINDSPEED_TEST_CRASH_AT"
CRASH_POINTS = (
    "before_write",  # the temporary folder is made, nothing written
    "before_checksums",  # every shard and .metadata written
    "checksums_written",  # checksums.json.tmp written, not renamed
    "after_checksums",  # the temporary folder is complete
    "old_moved_aside",  # an older checkpoint of this step moved to .trash_step_<N>
    "after_rename",  # step_<N> in place, `latest` still on the previous one
    "latest_written",  # latest.tmp written, not renamed
    "after_latest",  # `latest` names step_<N>, nothing pruned yet
    "pruning",  # one old checkpoint moved to .trash_step_<M>, not deleted
    "after_prune",  # the save is done but for the final barrier
)
_TMP_PREFIX = ".tmp_step_"
_SINGLE_PROCESS_NOTE = "torch.distributed is disabled, unavailable or uninitialized"
_TRASH_PREFIX = ".trash_step_"


class CheckpointManager:
    """Saves `states` every `interval` steps into `folder`, keeping the last `keep_last`.

    Args:
        states: name -> Stateful; every rank passes the same names.
        folder: directory shared by all ranks.
        interval: save when ``step % interval == 0``; 0 saves only when forced.
        keep_last: how many complete checkpoints to keep; 0 keeps all.
        async_save: write in a background thread; training continues on a staged
            copy. The previous async save is finished (and committed) before the
            next save or a load starts, and by `close()`.
        process_group: the group of ranks that save together (default: all).

    Raises:
        CheckpointError: bad settings; ConfigError: `folder` is (or lies under) a file.
    """

    def __init__(
        self,
        states: dict[str, Stateful],
        folder: str | os.PathLike,
        *,
        interval: int = 0,
        keep_last: int = 0,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ):
        if interval < 0 or keep_last < 0:
            raise CheckpointError(
                f"checkpoint interval={interval} and keep_last={keep_last} must be >= 0"
            )
        for name, state in states.items():
            if not callable(getattr(state, "state_dict", None)):
                raise CheckpointError(f"checkpoint state {name!r} has no state_dict()")
        self.states = dict(states)
        self.folder = check_folder(folder, "checkpoint folder")
        self.interval = interval
        self.keep_last = keep_last
        self.async_save = async_save
        self.process_group = process_group
        self._pending: tuple[Future, int] | None = None
        self._verified: set[int] = set()  # steps whose files this manager checked or wrote
        self._current: int | None = None  # the step the states hold as saved (loaded or saved)
        self._fallback: tuple[int | None] | None = None  # the step chosen without `latest`
        self._async_group = None
        if async_save and _distributed():
            # Background collectives need their own group, apart from training's.
            self._async_group = dist.new_group(backend="gloo")
        elif async_save:  # one process saves without collectives (`_write`), on DCP's thread,
            # which says so each time, outside any `catch_warnings` of ours
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE, category=UserWarning)

    # -- queries ----------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def latest_step(self) -> int | None:
        """The step to resume from (collective when `latest` is unusable).

        The step `latest` names; when it is missing, garbled or names a folder that is
        gone, the newest `step_<N>` whose checksums verify. None when there is none.

        Raises:
            CheckpointError: step folders exist but none of them verifies.
        """
        step = self._pointer()
        return step if step is not None else self._newest_verified()

    def saved_steps(self) -> list[int]:
        """Steps of the checkpoint folders in `folder`, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (parse_step(p) for p in self.folder.iterdir() if p.is_dir())
        return sorted(step for step in found if step is not None)

    def _pointer(self) -> int | None:
        """The step `latest` names, or None (with a warning when it is unusable)."""
        pointer = self.folder / LATEST
        if not pointer.is_file():
            return None
        text = pointer.read_text(errors="replace").strip()
        step = parse_step(text)
        if step is not None and (self.folder / text).is_dir():
            return step
        logger.warning("%s holds %r, not an existing step_<N>; ignoring it", pointer, text[:40])
        return None

    def _newest_verified(self) -> int | None:
        if self._fallback is None:
            self._fallback = (self._find_newest_verified(),)
        return self._fallback[0]

    def _find_newest_verified(self) -> int | None:
        steps = self.saved_steps()
        problems = []
        for step in reversed(steps):
            try:
                self._verify(step)
            except CheckpointError as err:
                logger.warning("skipping step_%d: %s", step, err)
                problems.append(str(err))
                continue
            logger.warning(
                "%s is missing or unusable: resuming from step_%d, the newest verified checkpoint",
                self.folder / LATEST,
                step,
            )
            return step
        if problems:
            more = f" (and {len(problems) - 1} older ones)" if len(problems) > 1 else ""
            raise CheckpointError(f"no usable checkpoint in {self.folder}: {problems[0]}{more}")
        return None

    def _verify(self, step: int) -> None:
        """Check all of step_<step> against its checksums (collective), once per manager.

        (A load checks what it reads as it reads it; this is for choosing a fallback.)"""
        if step in self._verified:
            return
        path = self.folder / f"step_{step}"
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {path} has no .metadata: the save did not complete")
        if not verify_checksums(path, self.process_group):
            logger.warning(
                "%s has no %s (an older save): loading it unverified", path, CHECKSUMS_FILE
            )
        self._verified.add(step)

    # -- save -------------------------------------------------------------------------

    def save(self, step: int, *, force: bool = False) -> bool:
        """Save when `step` falls on the interval (or `force`); True if a save started.

        A step the states already hold as saved (the one just loaded or saved) is not
        written again; `latest` is pointed at it.
        """
        if not (force or self.should_save(step)):
            return False
        self.wait()
        if _rank() == 0:
            self._sweep()  # what crashed saves left (we write here, so the folder is ours)
        if step == self._current and (self.folder / f"step_{step}").is_dir():
            if _rank() == 0 and self._pointer() != step:
                write_file_atomically(self.folder / LATEST, f"step_{step}\n")
            return False
        tmp = self.folder / f"{_TMP_PREFIX}{step}"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._barrier()
        _crash_point("before_write", step)
        try:
            self._write(step, tmp)
        except (Exception, CheckpointException) as err:
            self._abandon(tmp, err)
        return True

    def _write(self, step: int, tmp: Path) -> None:
        # One process (a world of 1 included) runs no collectives: gloo would run them in its
        # own threads, whose first tensor op starts a second OpenMP team, and libgomp then
        # stops spinning for the rest of the run (the demo lost 40% of its tokens/s after its
        # first checkpoint).
        kwargs = {"checkpoint_id": str(tmp), "no_dist": not _distributed(self.process_group)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE, category=UserWarning)
            if self.async_save:
                future = dcp.async_save(self.states, process_group=self._async_group, **kwargs)
                self._pending = (future, step)
            else:
                dcp.save(self.states, process_group=self.process_group, **kwargs)
        if not self.async_save:
            self._commit(step)

    def wait(self) -> None:
        """Finish and commit a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        try:
            future.result()
            self._commit(step)
        except (Exception, CheckpointException) as err:
            self._abandon(self.folder / f"{_TMP_PREFIX}{step}", err)

    def close(self) -> None:
        self.wait()

    def _abandon(self, tmp: Path, err: BaseException) -> None:
        """A save failed: remove its partial output and raise a user error where it is one."""
        # torch's zip writer reports a full disk as "unexpected pos ..." without the OSError:
        # a save that failed on a (nearly) full disk is taken for what it is.
        full = is_disk_full(err) or _nearly_full(tmp)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (self.folder / f"{LATEST}.tmp").unlink(missing_ok=True)
        if full:
            raise disk_full_error(tmp, _state_bytes(self.states)) from None
        if isinstance(err, CheckpointException):
            raise_user_error(err)
        raise err

    def _commit(self, step: int) -> None:
        self._barrier()  # every rank's shard files are written
        tmp, final = self.folder / f"{_TMP_PREFIX}{step}", self.folder / f"step_{step}"
        _crash_point("before_checksums", step)
        write_checksums(
            tmp, self.process_group, before_replace=lambda: _crash_point("checksums_written", step)
        )
        _crash_point("after_checksums", step)
        if _rank() == 0:
            self._install(tmp, final, step)
            write_file_atomically(
                self.folder / LATEST,
                f"step_{step}\n",
                before_replace=lambda: _crash_point("latest_written", step),
            )
            _crash_point("after_latest", step)
            self._prune(keep=step)
            _crash_point("after_prune", step)
            logger.info("saved checkpoint %s", final)
        self._verified.add(step)
        self._current = step
        self._fallback = None
        self._barrier()

    def _install(self, tmp: Path, final: Path, step: int) -> None:
        """Rename the complete `tmp` to `final`; an older `final` goes only after that."""
        trash = self.folder / f"{_TRASH_PREFIX}{step}"
        if final.exists():  # another run's checkpoint of this step, or a damaged one
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            _crash_point("old_moved_aside", step)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        _crash_point("after_rename", step)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, keep: int) -> None:
        """Delete all but the newest `keep_last` checkpoints (never `keep`)."""
        steps = self.saved_steps() if self.keep_last else []
        for step in steps[: -self.keep_last]:
            if step == keep:  # `latest` points here, whatever the numbering says
                continue
            trash = self.folder / f"{_TRASH_PREFIX}{step}"
            os.rename(self.folder / f"step_{step}", trash)
            _crash_point("pruning", keep)
            shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove what crashed saves left: temporary and half-deleted folders, latest.tmp."""
        if not self.folder.is_dir():
            return
        for prefix in (_TMP_PREFIX, _TRASH_PREFIX):
            for stale in self.folder.glob(f"{prefix}*"):
                shutil.rmtree(stale, ignore_errors=True)
        (self.folder / f"{LATEST}.tmp").unlink(missing_ok=True)

    # -- load -------------------------------------------------------------------------

    def load(self, step: int | None = None) -> int | None:
        """Load the checkpoint of `step` (default: see `latest_step`) into the states in place.

        Returns:
            The step loaded, or None when `step` is None and nothing was saved yet.

        Raises:
            CheckpointError: the checkpoint is missing, incomplete, corrupt (the shard is
                named), unsafe, or of another model.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        path = self.folder / f"step_{step}"
        if not path.is_dir():
            have = ", ".join(map(str, self.saved_steps())) or "none"
            raise CheckpointError(f"no checkpoint {path} (saved steps: {have})")
        if read_checksums(path) is None:
            logger.warning(
                "%s has no %s (an older save): loading it unverified", path, CHECKSUMS_FILE
            )
        shared = {k: v for k, v in self.states.items() if not getattr(v, "per_rank", False)}
        per_rank = {k: v for k, v in self.states.items() if getattr(v, "per_rank", False)}
        metadata = read_metadata(path)
        check_files(path, metadata)
        check_states(path, metadata, shared)
        load_dcp(shared, path, process_group=self.process_group)
        if per_rank:
            planner = DefaultLoadPlanner(allow_partial_load=True)
            load_dcp(per_rank, path, planner=planner, process_group=self.process_group)
        self._current = step
        logger.info("loaded checkpoint %s", path)
        return step

    def _barrier(self) -> None:
        if _distributed(self.process_group):
            dist.barrier(group=self.process_group)


def _crash_point(name: str, step: int) -> None:
    """Tests only: die here, as a power cut would, when MINDSPEED_TEST_CRASH_AT says so."""
    wanted = os.environ.get(CRASH_ENV)
    if wanted and wanted in (name, f"{name}@{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _nearly_full(path: Path, margin: int = 1 << 20) -> bool:
    """Whether the file system holding `path` has less than `margin` bytes free."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < margin
    except OSError:
        return False


def _state_bytes(states: dict[str, Stateful]) -> int:
    """About how many bytes a checkpoint of `states` takes (global tensor sizes)."""
    total = 0
    for state in states.values():
        stack = [state.state_dict()]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack += value.values()
            elif isinstance(value, list | tuple):
                stack += value
            elif isinstance(value, DTensor | torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether there are other processes to talk to (in `group`, default: the world)."""
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
