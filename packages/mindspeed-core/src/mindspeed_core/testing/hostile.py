"""Hostile checkpoints for tests: DCP folders whose pickles would run a command.

Public so that packages above core (and embedders) test their own loaders the same way:
plant one of these, load, and assert that `marker` was never created.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from mindspeed_core.checkpoint.integrity import CHECKSUMS_FILE, file_sha256, write_checksums


class _Command:
    """Unpickles into a call of os.system(command): what an attacker ships."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def touch_command(marker: Path) -> str:
    return f"touch {marker}"


def plant_hostile_torch_file(path: Path, marker: Path) -> None:
    """A `torch.save` file (a cache, a state) whose pickle creates `marker` when loaded
    without `weights_only`."""
    torch.save(_Command(touch_command(marker)), path)


def plant_hostile_metadata(step_dir: Path, marker: Path) -> None:
    """Replace `.metadata` with a pickle that creates `marker` when unpickled, and
    re-record the checksums as a careful attacker would."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Command(touch_command(marker))))
    checksums = step_dir / CHECKSUMS_FILE
    if checksums.is_file():
        body = json.loads(checksums.read_text())
        body["metadata"] = file_sha256(step_dir / ".metadata")
        checksums.write_text(json.dumps(body))


def plant_hostile_item(step_dir: Path, key: str, marker: Path) -> None:
    """Rewrite the DCP checkpoint `step_dir` with its non-tensor item `key` (dotted,
    e.g. "train.step") replaced by a pickle that creates `marker` when loaded with
    `weights_only=False`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(checkpoint_id=str(step_dir))
        node, leaf = _parent_of(state, key)
        assert not isinstance(node[leaf], torch.Tensor), f"{key} is a tensor"
        node[leaf] = _Command(touch_command(marker))
        for stale in step_dir.iterdir():
            stale.unlink()
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    _rechecksum(step_dir)


def _parent_of(state: dict, key: str) -> tuple[dict, str]:
    """The dict holding `key` (flat "a.b" or nested a -> b) and the key inside it."""
    if key in state:
        return state, key
    head, _, rest = key.partition(".")
    if head not in state or not rest:
        raise KeyError(f"{key} is not in the checkpoint (top level: {sorted(state)[:8]})")
    return _parent_of(state[head], rest)


def _rechecksum(step_dir: Path) -> None:
    if (step_dir / CHECKSUMS_FILE).is_file():
        (step_dir / CHECKSUMS_FILE).unlink()
        write_checksums(step_dir)
