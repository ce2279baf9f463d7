"""What the alignment commands share around the trainer: the demo's warm start, the layouts they refuse, evaluation mode, reading data units, writing demo files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.files import staged_folder
from mindspeed_llm.data.sft import SFTStats

__all__ = [
    "check_layout",
    "evaluating",
    "read_units",
    "warm_start_for_demo",
    "write_folder",
]


def warm_start_for_demo(cfg, info) -> dict | None:
    """The SFT warm start's state (`dpo_demo.warm_start`) when the run is the demo (no
    `data.paths`), else None."""
    if cfg.data.paths:
        return None
    from mindspeed_align.dpo_demo import warm_start

    return warm_start(cfg, info)


def check_layout(cfg, command: str) -> None:
    """Refuse context and pipeline parallel and LoRA, which these commands do not support yet."""
    if cfg.parallel.cp > 1 or cfg.parallel.pp > 1:
        raise ConfigError(f"{command}: parallel.cp={cfg.parallel.cp}, parallel.pp={cfg.parallel.pp}: "
                          "context and pipeline parallel are not supported yet (tp and dp are)")  # fmt: skip
    if cfg.lora.rank:
        raise ConfigError(f"{command}: lora.rank > 0 is not supported yet")


@contextlib.contextmanager
def evaluating(model) -> Iterator:
    """`model` in eval mode for the block, then back to the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def read_units(
    data, read: Callable[[str], list], length: Callable[[object], int]
) -> tuple[list, SFTStats]:
    """Every unit `read(path)` gives for `data.paths`; units whose `length` exceeds
    `data.seq_len` are left out and counted as dropped.

    Raises:
        DataError: no unit is left.
    """
    stats, units = SFTStats(), []
    for path in data.paths:
        found = read(path)
        stats.records += len(found)
        kept = [u for u in found if length(u) <= data.seq_len]
        stats.dropped += len(found) - len(kept)
        units += kept
    stats.samples = len(units)
    if not units:
        raise DataError(
            f"data.paths {data.paths}: nothing fits data.seq_len={data.seq_len} ({stats.line()})"
        )
    return units, stats


def write_folder(folder: Path, files: dict[str, list[dict]]) -> None:
    """`folder` holding one JSONL file per name, all or nothing (built beside it, renamed)."""
    with staged_folder(folder) as staging:
        for name, rows in files.items():
            (staging / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
