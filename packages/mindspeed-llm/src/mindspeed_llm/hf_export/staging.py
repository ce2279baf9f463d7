"""What every conversion shares: an output folder staged and renamed only when complete, the
files copied next to the weights, progress bars.

The output is written to `OUT.tmp-HOST.PID.*` and renamed to `OUT` when complete: a
failed conversion (a full disk included) leaves nothing behind, and the temporaries of a
convert that was killed are removed by the next one into the same place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from mindspeed_core.checkpoint import LATEST
from mindspeed_core.errors import ConfigError, disk_full_error, is_disk_full
from mindspeed_core.files import check_folder, fsync_dir, owned_temp_prefix, remove_stale_temps
from mindspeed_llm.hf_export.hf_out import ShardedWriter
from mindspeed_llm.models import hf_io

logger = logging.getLogger("mindspeed.convert")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
HF_EXTRA_FILES = ("generation_config.json", *TOKENIZER_FILES)


def nbytes(entries) -> int:
    """Bytes of (name, dtype, shape) `entries`: what an output needs on disk."""
    return sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries)


def write_safetensors(tmp: Path, items, entries, shards, dtype) -> None:
    """Write `items` ((name, tensor) pairs, in any order, each dropped once written) into
    the planned `shards` (and the index when several)."""
    with ShardedWriter(tmp, entries, shards, dtype) as writer:
        for name, tensor in items:
            writer.write(name, tensor)


def copy_tokenizer(tokenizer: Path, dest: Path) -> None:
    """The run's tokenizer: a folder's tokenizer files, a tokenizer.json, or a sentencepiece
    .model (saved as tokenizer.model)."""
    if tokenizer.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, dest / name)
    elif tokenizer.suffix == ".json":
        shutil.copy2(tokenizer, dest / "tokenizer.json")
    elif tokenizer.suffix == ".model":
        shutil.copy2(tokenizer, dest / "tokenizer.model")


def progress(total: int, desc: str) -> tqdm:
    """A tensor-count progress bar on an interactive terminal (silent in logs and tests)."""
    return tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty())


def counted(items, bar: tqdm):
    """`items`, advancing `bar` by one for each."""
    for item in items:
        yield item
        bar.update(1)


def copy_hf_files(source: Path, dest: Path) -> list[str]:
    """Copy config.json, the generation config and tokenizer files that exist in `source`."""
    copied = []
    for name in (hf_io.CONFIG_FILE, *HF_EXTRA_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
            if name != hf_io.CONFIG_FILE:
                copied.append(name)
    return copied


@contextlib.contextmanager
def staged_output(output: str | Path, needed_bytes: int) -> Iterator[Path]:
    """A fresh `OUT.tmp-HOST.PID.*` folder, renamed to `output` on success and removed on
    failure (a full disk becomes one line). Temporaries a killed convert left next to
    `output` are removed first. An `output` that is an existing empty folder (a container's
    volume: a mount point, which cannot be renamed over, under a parent that may be
    read-only) gets the folder inside it, and its entries are moved up at the end."""
    out = Path(output)
    inside = out.is_dir()
    if inside:
        remove_stale_temps(out, out.name)
    if out.exists() and (not inside or any(out.iterdir())):
        raise ConfigError(f"output {out} already exists; remove it or choose another path")
    check_folder(out.parent, "--output's folder")
    home = out if inside else out.parent
    made = [] if inside else [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        home.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temps(home, out.name):
            logger.debug("removed %s, left by a convert that was killed", stale)
        tmp = Path(tempfile.mkdtemp(prefix=owned_temp_prefix(out.name), dir=home))
    except OSError as err:
        _remove_made(made)
        raise ConfigError(
            f"--output {out}: cannot write in {home}: {err.strerror or err}"
        ) from None
    moved: list[Path] = []
    try:
        yield tmp
        if inside:
            _move_entries(tmp, out, moved)
        else:
            os.rename(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        for entry in moved:  # moved up before the failure
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(
                missing_ok=True
            )
        _remove_made(made)
        if is_disk_full(err):
            raise disk_full_error(out, needed_bytes) from None
        raise


_WRITTEN_LAST = (hf_io.CONFIG_FILE, "model.safetensors.index.json", LATEST, ".metadata")
"""What readers look for first: moved into an output folder after the rest."""


def _move_entries(staging: Path, out: Path, moved: list[Path]) -> None:
    """Move `staging`'s entries into `out` (same file system: renames; each one `moved`),
    those that make a folder look complete last, and remove `staging`."""
    entries = sorted(staging.iterdir(), key=lambda p: (p.name in _WRITTEN_LAST, p.name))
    for entry in entries:
        os.rename(entry, out / entry.name)
        moved.append(out / entry.name)
    staging.rmdir()
    fsync_dir(out)


def _remove_made(made: list[Path]) -> None:
    for parent in made:  # innermost first: the folders this call created
        with contextlib.suppress(OSError):
            parent.rmdir()
