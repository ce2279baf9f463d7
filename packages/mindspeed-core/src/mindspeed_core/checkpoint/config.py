"""`CheckpointConfig`: the `checkpoint` section of every training command."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.checkpoint.manager import CheckpointManager


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: Path | None = None
    """Checkpoint folder (default: <run_dir>/checkpoints)."""
    interval: int = 100
    """Save every N steps and at the end (0: only at the end)."""
    keep_last: int = 2
    """Complete checkpoints to keep (0: all)."""
    load: Literal["auto", "none"] | Path = "auto"
    """auto: resume from `dir` when it holds a checkpoint; none; or a checkpoint folder."""
    async_save: bool = False
    """Write checkpoints in a background thread while training goes on."""

    def folder(self, run_dir: str | os.PathLike) -> Path:
        """Where checkpoints go: `dir`, or `<run_dir>/checkpoints`."""
        return Path(self.dir) if self.dir is not None else Path(run_dir) / "checkpoints"

    def manager(self, states: dict[str, Stateful], run_dir: str | os.PathLike) -> CheckpointManager:
        """A `CheckpointManager` of `states` with this section's folder and cadence."""
        return CheckpointManager(
            states,
            self.folder(run_dir),
            interval=self.interval,
            keep_last=self.keep_last,
            async_save=self.async_save,
        )
