"""Names of a checkpoint folder: `step_<N>` folders and the `latest` pointer.

One parser for the layout `CheckpointManager` writes, so every reader (resume,
`mindspeed convert`, model loading) agrees on it::

    root/step_200/      a complete checkpoint
    root/latest         text: "step_200"
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mindspeed_core.errors import CheckpointError

LATEST = "latest"
"""The file in a checkpoint root naming its newest complete step folder."""
_STEP_NAME = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    """The folder name of `step`: "step_<N>"."""
    return f"step_{step}"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The folder of `step` under the checkpoint root `root`."""
    return Path(root) / step_name(step)


def parse_step(path: str | os.PathLike) -> int | None:
    """N for a folder (or name) "step_<N>", else None."""
    return _parse_name(Path(path).name)


def checkpoint_root(path: str | os.PathLike) -> Path:
    """The folder holding `latest` and the step folders: the parent of a step folder,
    else `path` itself."""
    path = Path(path)
    return path.parent if parse_step(path) is not None else path


def read_latest(root: str | os.PathLike) -> int | None:
    """The step `root/latest` names, or None when there is no pointer.

    Raises:
        CheckpointError: the pointer holds something other than "step_<N>".
    """
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    step = _parse_name(text)
    if step is None:
        raise CheckpointError(f"{pointer} holds {text!r}, not step_<N>")
    return step


def resolve(path: str | os.PathLike) -> Path:
    """The step folder to read: `path` itself when it is a step_<N>, else the one
    `path/latest` names.

    Raises:
        CheckpointError: no `latest` pointer, a corrupt one, or one naming a missing folder.
    """
    path = Path(path)
    if parse_step(path) is not None:
        return path
    step = read_latest(path)
    if step is None:
        raise CheckpointError(f"checkpoint folder {path} has no {LATEST} pointer")
    folder = step_dir(path, step)
    if not folder.is_dir():
        raise CheckpointError(
            f"{path / LATEST} names {folder.name!r}, which is not a step folder here"
        )
    return folder


def _parse_name(name: str) -> int | None:
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None
