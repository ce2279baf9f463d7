"""What the alignment commands share around the trainer: the demo's warm start, the layouts they refuse, evaluation mode, reading data units, writing demo files."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.files import staged_folder
from mindspeed_llm.data.sft import SFTStats
from mindspeed_llm.models.common.attention import Attention

__all__ = [
    "check_layout",
    "evaluating",
    "read_units",
    "shares_prompts",
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


def shares_prompts(mode: str, run, section: str) -> bool:
    """`{section}.shared_prompts` (auto, on or off): whether the packed rows hold each prompt
    once for all of its replies (`SharedKeys`). It needs every rank to see whole documents
    (no pipeline or context parallel), no MTP and softmax attention layers (their keys are
    gathered per document); `auto` is off elsewhere (and logs why), `on` refused."""
    if mode == "off":
        return False
    why = None
    if run.dims.pp > 1 or run.dims.cp > 1:
        why = "pipeline or context parallel"
    elif run.model_config.num_nextn_predict_layers:
        why = "MTP"
    else:
        layers = [m for m in run.policy.model.modules() if hasattr(m, "attention")]
        others = {type(m.attention).__name__ for m in layers} - {Attention.__name__}
        why = f"{', '.join(sorted(others))} layers" if others else None
    if why is not None and mode == "on":
        raise ConfigError(f"{section}.shared_prompts=on: prompts cannot be shared under {why} "
                          "(their keys must be gathered per document); use auto or off")  # fmt: skip
    if why is not None:
        logging.getLogger(f"mindspeed.{section}").info(
            "%s: each reply's row holds its own copy of the prompt (%s.shared_prompts=auto is "
            "off under %s)", section, section, why)  # fmt: skip
    return why is None
