"""`CheckpointManager`: save and load training state with DCP, atomically.

Layout of `folder`::

    step_200/            a complete DCP checkpoint (.metadata + one file per writer)
    step_300/
    latest               text: "step_300"
    .tmp_step_400/       a save in progress (or one that crashed); never loaded

A save writes into ``.tmp_step_<N>``, then (rank 0, after every rank finished)
renames it to ``step_<N>`` and only then replaces ``latest`` (write-then-rename,
atomic on POSIX). A crash at any point leaves ``latest`` on the previous complete
checkpoint. DCP stores each tensor by name with its global shape, so a checkpoint
saved under one layout loads into any other.

States are `Stateful` objects (model, optimizer, scheduler, train state, data
position, ...). One marked ``per_rank = True`` (like `RNGState`) is keyed by rank;
a rank with no saved entry keeps its current state.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint.steps import LATEST, parse_step, read_latest
from mindspeed_core.checkpoint.verify import check_files, check_states, read_metadata
from mindspeed_core.errors import CheckpointError

logger = logging.getLogger("mindspeed.checkpoint")
_TMP_PREFIX = ".tmp_step_"


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
        self.folder = Path(folder)
        self.interval = interval
        self.keep_last = keep_last
        self.async_save = async_save
        self.process_group = process_group
        self._pending: tuple[Future, int] | None = None
        self._async_group = None
        if async_save and _distributed():
            # Background collectives need their own group, apart from training's.
            self._async_group = dist.new_group(backend="gloo")

    # -- queries ----------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def latest_step(self) -> int | None:
        """The step `latest` points to, or None when there is no complete checkpoint."""
        return read_latest(self.folder)

    def saved_steps(self) -> list[int]:
        """Steps of the complete checkpoints in `folder`, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (parse_step(p) for p in self.folder.iterdir() if p.is_dir())
        return sorted(step for step in found if step is not None)

    # -- save -------------------------------------------------------------------------

    def save(self, step: int, *, force: bool = False) -> bool:
        """Save when `step` falls on the interval (or `force`); True if a save started."""
        if not (force or self.should_save(step)):
            return False
        self.wait()
        tmp = self.folder / f"{_TMP_PREFIX}{step}"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt at this step
        self._barrier()
        if self.async_save:
            future = dcp.async_save(
                self.states,
                checkpoint_id=str(tmp),
                process_group=self._async_group,
                no_dist=not dist.is_initialized(),
            )
            self._pending = (future, step)
        else:
            dcp.save(
                self.states,
                checkpoint_id=str(tmp),
                process_group=self.process_group,
                no_dist=not dist.is_initialized(),
            )
            self._commit(step)
        return True

    def wait(self) -> None:
        """Finish and commit a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        future.result()
        self._commit(step)

    def close(self) -> None:
        self.wait()

    def _commit(self, step: int) -> None:
        self._barrier()  # every rank's shard files are written
        if _rank() == 0:
            final = self.folder / f"step_{step}"
            if final.exists():  # re-saving a step (after a resume): replace it
                shutil.rmtree(final)
            os.rename(self.folder / f"{_TMP_PREFIX}{step}", final)
            _write_atomically(self.folder / LATEST, f"step_{step}\n")
            self._prune(keep=step)
            logger.info("saved checkpoint %s", final)
        self._barrier()

    def _prune(self, keep: int) -> None:
        if self.keep_last == 0:
            return
        steps = self.saved_steps()
        for step in steps[: -self.keep_last]:
            if step == keep:  # `latest` points here, whatever the numbering says
                continue
            shutil.rmtree(self.folder / f"step_{step}", ignore_errors=True)
        for tmp in self.folder.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)

    # -- load -------------------------------------------------------------------------

    def load(self, step: int | None = None) -> int | None:
        """Load the checkpoint of `step` (default: `latest`) into the states in place.

        Returns:
            The step loaded, or None when `step` is None and nothing was saved yet.

        Raises:
            CheckpointError: the checkpoint is missing, incomplete, or of another model.
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
        shared = {k: v for k, v in self.states.items() if not getattr(v, "per_rank", False)}
        per_rank = {k: v for k, v in self.states.items() if getattr(v, "per_rank", False)}
        metadata = read_metadata(path)
        check_files(path, metadata)
        check_states(path, metadata, shared)
        no_dist = not dist.is_initialized()
        dcp.load(shared, checkpoint_id=str(path), process_group=self.process_group, no_dist=no_dist)
        if per_rank:
            dcp.load(
                per_rank,
                checkpoint_id=str(path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                process_group=self.process_group,
                no_dist=no_dist,
            )
        logger.info("loaded checkpoint %s", path)
        return step

    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self.process_group)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
