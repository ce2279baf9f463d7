"""Checksums of a checkpoint's files: written at save, verified at load.

`checksums.json` in a DCP folder lists every other file with its size and SHA-256. It
is written after every rank's files and `.metadata` are on disk and before the folder
is renamed to `step_<N>`, so a `step_<N>` with checksums is complete by construction,
and a flipped byte anywhere (a tensor record, the metadata) is caught before loading.

Hashing is spread over the ranks: the files DCP names `__<r>_<k>.distcp` belong to
rank ``r % world`` (the one that just wrote them, at save time), everything else to
rank 0, and the digests are gathered so every rank reaches the same verdict.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mindspeed_core.errors import CheckpointError
from mindspeed_core.files import write_file_atomically

CHECKSUMS_FILE = "checksums.json"
FORMAT = "mindspeed-checksums"
_RANK_FILE = re.compile(r"^__(\d+)_")
_CHUNK = 8 << 20

Digests = dict[str, dict[str, int | str]]


def file_digest(path: Path) -> dict[str, int | str]:
    """{"size", "sha256"} of one file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def gather_digests(
    folder: Path, names: list[str], group: dist.ProcessGroup | None = None
) -> Digests:
    """Digests of `names` in `folder`, each hashed by one rank, gathered on every rank."""
    rank, world = _place(group)
    mine = {n: file_digest(folder / n) for n in names if _owner(n, world) == rank}
    if world == 1:
        return mine
    parts: list[Digests | None] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return {name: d for part in parts if part for name, d in part.items()}


def write_checksums(
    folder: Path,
    group: dist.ProcessGroup | None = None,
    *,
    before_replace: Callable[[], None] | None = None,
) -> Digests:
    """Hash every file of the DCP folder `folder` (collective); rank 0 writes the list.

    Rank 0 lists the folder and shares the names, so every rank hashes the same set.
    `before_replace` runs on rank 0 between writing the temporary file and renaming it.
    """
    rank, world = _place(group)
    names = sorted(p.name for p in folder.iterdir() if p.is_file()) if rank == 0 else None
    if world > 1:
        box = [names]
        dist.broadcast_object_list(box, src=_global_rank0(group), group=group)
        names = box[0]
    names = [n for n in names if n != CHECKSUMS_FILE]
    digests = gather_digests(folder, names, group)
    if rank == 0:
        body = {"format": FORMAT, "version": 1, "algorithm": "sha256", "files": digests}
        text = json.dumps(body, indent=1, sort_keys=True)
        write_file_atomically(folder / CHECKSUMS_FILE, text, before_replace=before_replace)
    return digests


def read_checksums(folder: Path) -> Digests | None:
    """The recorded digests of `folder`, or None when it has no checksums file (a
    checkpoint saved before checksums existed, or by another tool)."""
    path = folder / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError("not a checksums file")
        return {
            str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])} for k, v in files.items()
        }
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint checksums {path} are corrupt: {err}") from None


def verify_checksums(folder: Path, group: dist.ProcessGroup | None = None) -> bool:
    """Check every file of `folder` against its checksums (collective).

    Returns:
        True when verified, False when the folder has no checksums to check against.

    Raises:
        CheckpointError: a file is missing, of another size or another content (named).
    """
    expected = read_checksums(folder)
    if expected is None:
        return False
    present = {n for n in expected if (folder / n).is_file()}
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(f"checkpoint {folder} is missing shard file {missing[0]}")
    sized = sorted(n for n in present if (folder / n).stat().st_size == expected[n]["size"])
    for name in sorted(present - set(sized)):
        size, want = (folder / name).stat().st_size, expected[name]["size"]
        state = "is truncated" if size < want else "has grown"
        raise CheckpointError(f"checkpoint shard {folder / name} {state} ({size} of {want} bytes)")
    actual = gather_digests(folder, sized, group)
    for name in sized:
        if actual[name]["sha256"] != expected[name]["sha256"]:
            raise CheckpointError(
                f"checkpoint shard {folder / name} is corrupt: its SHA-256 differs from the one "
                f"recorded at save in {CHECKSUMS_FILE}"
            )
    return True


def _owner(name: str, world: int) -> int:
    match = _RANK_FILE.match(name)
    return int(match.group(1)) % world if match else 0


def _place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank0(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)
