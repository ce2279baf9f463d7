"""The run directory of a training command, in one place, and where a run resumes from.

    <run_dir>/config.yaml        the fully resolved config (rank 0, at start)
    <run_dir>/metrics.jsonl      one JSON object per logged step (lines after a resumed
                                 step are dropped, so a rerun never duplicates steps)
    <run_dir>/tb/                TensorBoard events
    <run_dir>/wandb/             Weights & Biases files (logging.wandb), wandb-run-id
    <run_dir>/checkpoints/       step_<N>/ and latest (unless checkpoint.dir says otherwise)
    <run_dir>/loss_curve.png     at the end

`resume` applies `checkpoint.load`: the run's own checkpoints win (running the same
command again continues the run), else a given folder, where one holding only model
weights (a `mindspeed convert` output) starts a fresh run at step 0, and one holding the
model and the optimizer's state alone (`mindspeed convert --from megatron
--with-optimizer`, at `step_<N>`) goes on from step N: the weights, Adam's moments and
step count load; the LR schedule stands at step N of this run's schedule; lr, betas, eps
and weight decay are this run's config; the data starts at the beginning of this run's
data (Megatron's sample order is its own), the random generators fresh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint import CheckpointManager, ModelState
from mindspeed_core.checkpoint.steps import checkpoint_root, parse_step, step_dir
from mindspeed_core.config import dump_yaml
from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimizerMoments
from mindspeed_core.training import MetricsWriter, RunLock, acquire_run_lock, release_all
from mindspeed_core.training.run_lock import LOCK_FILE
from mindspeed_llm.models import checkpoint_io
from mindspeed_llm.train.plots import plot_loss_curve

logger = logging.getLogger("mindspeed.train")

__all__ = ["RunDirectory", "resume"]


class RunDirectory:
    """Writes a run's files; only rank 0 touches the disk."""

    def __init__(self, path: str | Path, *, tensorboard: bool = True, wandb=None):
        self.path = Path(path)
        self.tensorboard, self.wandb = tensorboard, wandb
        self._created: list[Path] = []

    def lock(self, checkpoints: Path) -> list[RunLock]:
        """Take the run directory (and a checkpoint folder outside it) for this run: a
        second run into either refuses at once, naming the holder (collective)."""
        folders = [(self.path, "--logging.run_dir")]
        if not Path(checkpoints).resolve().is_relative_to(self.path.resolve()):
            folders.append((checkpoints, "--checkpoint.dir"))
        self._created = [top for f, _ in folders if (top := _first_missing(Path(f)))]
        return acquire_run_lock(*folders)

    def unlock(self, locks: list[RunLock], *, discard: bool) -> None:
        """Release the locks; with `discard` (the run stopped before writing anything), the
        folders taking the lock created are removed again, so a refused run leaves
        nothing behind."""
        if discard and is_rank0():
            for top in self._created:
                _remove_if_only_locks(top)
        release_all(locks)

    def start(self, cfg: Any, resumed_step: int | None) -> MetricsWriter:
        """Write config.yaml and open metrics.jsonl, keeping its lines up to `resumed_step`
        (none for a fresh run: a run that died before its first checkpoint left some)."""
        if is_rank0():
            self.path.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.path / "config.yaml")
        return MetricsWriter(
            self.path, tensorboard=self.tensorboard, resume_step=resumed_step or 0, wandb=self.wandb
        )

    def finish(self) -> None:
        """The loss curve of the whole run."""
        if is_rank0():
            plot_loss_curve(self.path / "metrics.jsonl", self.path / "loss_curve.png")


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None: it exists)."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            return missing
        missing = folder
    return missing


def _remove_if_only_locks(top: Path) -> None:
    """Remove `top` if all it holds is empty folders and lock files."""
    files = [p for p in top.rglob("*") if not p.is_dir()]
    if top.is_dir() and all(p.name == LOCK_FILE for p in files):
        for p in files:
            p.unlink()
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            folder.rmdir()
        top.rmdir()


def resume(checkpoints: CheckpointManager, load: str | Path, states: dict[str, Stateful]):
    """Load what `checkpoint.load` says into `states`; the step to go on from, or None
    for a fresh run."""
    if load == "none":
        return None
    if load == "auto" or checkpoints.latest_step() is not None:
        step = checkpoints.load()
    else:
        step = _load_from(Path(load), states)
        if step is None:  # model weights only: a fresh run starting at step 0
            step = 0
    if step is not None:
        logger.info("resumed from step %d", step)
    return step


def _load_from(path: Path, states: dict[str, Stateful]) -> int | None:
    """checkpoint.load given as a folder of checkpoints or one step_<N> folder.

    A checkpoint holding only the model (e.g. from `mindspeed convert`) gives the weights;
    training then starts at step 0 with a fresh optimizer (returns None).
    """
    step = parse_step(path)
    root = checkpoint_root(path)
    if step is None:
        step = CheckpointManager(states, root).latest_step()
    if step is None:
        raise ConfigError(f"checkpoint.load={path} holds no checkpoint")
    saved = checkpoint_io.saved_states(step_dir(root, step))
    model = states["model"]
    adapters = getattr(model, "trainable_only", False)
    if saved == {"model", "optimizer"} and not adapters:
        return _load_converted_training(root, step, states)
    if saved in ({"model"}, {"model", "optimizer"}):
        if adapters:  # adapters: the checkpoint is their base (its optimizer state is not theirs)
            model = ModelState(model.model_parts, frozen_only=True)
        CheckpointManager({"model": model}, root).load(step)
        logger.info("loaded the model weights of %s; training starts at step 0", path)
        return None
    return CheckpointManager(states, root).load(step)


def _load_converted_training(root: Path, step: int, states: dict[str, Stateful]) -> int:
    """Weights and Adam's state of a converted training checkpoint; the step counter and
    the LR schedule set to its step (see the module doc)."""
    moments = OptimizerMoments(states["optimizer"])
    CheckpointManager({"model": states["model"], "optimizer": moments}, root).load(step)
    states["train"].step = step
    states["scheduler"].load_state_dict({"last_epoch": step})
    logger.info(
        "loaded the weights and optimizer state of %s; training goes on from step %d "
        "(the data from its beginning)", root / f"step_{step}", step,
    )
    return step
