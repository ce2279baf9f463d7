"""Checksums of a checkpoint's records: written at save, verified whenever one is read.

`checksums.json` in a DCP folder holds the SHA-256 of `.metadata`, the size of every
shard file and the SHA-256 of every record (one tensor chunk or non-tensor item: the
byte range `.metadata` points to). It is written after every rank's files and
`.metadata` are on disk and before the folder is renamed to `step_<N>`, so a
`step_<N>` with checksums is complete by construction.

`SafeFileSystemReader` checks `.metadata` and each record it is about to read against
these digests, so a flipped byte is refused naming the shard, and a reader that needs
only the model (generate, convert) hashes only the model's records. `verify_checksums`
checks everything (used when picking a checkpoint to fall back to).

Hashing is spread over the ranks: the files DCP names `__<r>_<k>.distcp` belong to
rank ``r % world`` (at save, the one that just wrote them), everything else to rank 0,
and the digests are gathered so every rank reaches the same verdict.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import torch.distributed as dist

from mindspeed_core.checkpoint.safe_pickle import METADATA_FILE, unpickle_metadata
from mindspeed_core.errors import CheckpointError
from mindspeed_core.files import write_file_atomically

CHECKSUMS_FILE = "checksums.json"
FORMAT = "mindspeed-checksums"
_RANK_FILE = re.compile(r"^__(\d+)_")
_CHUNK = 8 << 20

Records = dict[str, dict[int, int]]  # file -> {offset: length}


class Checksums:
    """The digests recorded for one checkpoint folder."""

    def __init__(self, folder: Path, body: dict):
        self.folder = folder
        self.metadata: str = body["metadata"]
        self.sizes: dict[str, int] = {str(k): int(v) for k, v in body["files"].items()}
        self.records: dict[str, dict[int, str]] = {
            str(f): {int(o): str(d) for o, d in recs.items()} for f, recs in body["records"].items()
        }

    def check_metadata(self) -> None:
        """`.metadata` is the one saved (before it is unpickled)."""
        if file_sha256(self.folder / METADATA_FILE) != self.metadata:
            raise CheckpointError(
                f"checkpoint {self.folder / METADATA_FILE} is corrupt: its SHA-256 differs from "
                f"the one recorded at save in {CHECKSUMS_FILE}"
            )

    def check_sizes(self) -> None:
        for name, size in sorted(self.sizes.items()):
            path = self.folder / name
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.folder} is missing shard file {name}")
            actual = path.stat().st_size
            if actual != size:
                state = "is truncated" if actual < size else "has grown"
                raise CheckpointError(f"checkpoint shard {path} {state} ({actual} of {size} bytes)")

    def check_records(self, name: str, spans: Iterable[tuple[int, int]]) -> None:
        """The records (offset, length) of shard `name` hash as recorded."""
        recorded = self.records.get(name, {})
        with open(self.folder / name, "rb") as f:
            for offset, length in sorted(set(spans)):
                expected = recorded.get(offset)
                if expected is None or range_sha256(f, offset, length) != expected:
                    raise CheckpointError(
                        f"checkpoint shard {self.folder / name} is corrupt: the record at byte "
                        f"{offset} differs from the one recorded at save in {CHECKSUMS_FILE}"
                    )


def read_checksums(folder: Path) -> Checksums | None:
    """The recorded digests of `folder`, or None when it has none (saved before checksums
    existed, or by another tool)."""
    path = folder / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise ValueError("not a checksums file")
        return Checksums(folder, body)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint checksums {path} are corrupt: {err}") from None


def write_checksums(
    folder: Path,
    group: dist.ProcessGroup | None = None,
    *,
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Hash `.metadata` and every record of the DCP folder `folder` (collective); rank 0
    writes `checksums.json`. `before_replace` runs on rank 0 before its final rename."""
    records = storage_records(unpickle_metadata(folder).storage_data.values())
    digests = _gather(folder, records, group)
    rank, _ = _place(group)
    if rank != 0:
        return
    body = {
        "format": FORMAT,
        "version": 1,
        "algorithm": "sha256",
        "metadata": file_sha256(folder / METADATA_FILE),
        "files": {name: (folder / name).stat().st_size for name in sorted(records)},
        "records": {
            name: {str(o): d for o, d in sorted(recs.items())} for name, recs in digests.items()
        },
    }
    text = json.dumps(body, indent=1, sort_keys=True)
    write_file_atomically(folder / CHECKSUMS_FILE, text, before_replace=before_replace)


def verify_checksums(folder: Path, group: dist.ProcessGroup | None = None) -> bool:
    """Check `.metadata`, every shard's size and every record of `folder` (collective).

    Returns:
        True when verified, False when the folder has no checksums to check against.

    Raises:
        CheckpointError: a file is missing, truncated or corrupt (named).
    """
    checksums = read_checksums(folder)
    if checksums is None:
        return False
    checksums.check_metadata()
    checksums.check_sizes()
    records = storage_records(unpickle_metadata(folder).storage_data.values())
    actual = _gather(folder, records, group)
    for name in sorted(records):
        if actual.get(name) != checksums.records.get(name):
            bad = min(
                o
                for o in records[name]
                if actual[name][o] != checksums.records.get(name, {}).get(o)
            )
            raise CheckpointError(
                f"checkpoint shard {folder / name} is corrupt: the record at byte {bad} differs "
                f"from the one recorded at save in {CHECKSUMS_FILE}"
            )
    return True


def storage_records(infos: Iterable) -> Records:
    """file -> {offset: length} from DCP's `_StorageInfo`s."""
    out: Records = {}
    for info in infos:
        out.setdefault(info.relative_path, {})[int(info.offset)] = int(info.length)
    return out


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return range_sha256(f, 0, None)


def range_sha256(f: BinaryIO, offset: int, length: int | None) -> str:
    """SHA-256 of `length` bytes (None: to the end) from `offset`, read in chunks."""
    digest = hashlib.sha256()
    f.seek(offset)
    left = length
    while left is None or left > 0:
        chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        if left is not None:
            left -= len(chunk)
    return digest.hexdigest()


def _gather(folder: Path, records: Records, group) -> dict[str, dict[int, str]]:
    """Digests of every record, each file hashed by its owner rank, gathered on all ranks."""
    rank, world = _place(group)
    mine = {}
    for name, spans in records.items():
        if _owner(name, world) != rank:
            continue
        with open(folder / name, "rb") as f:
            mine[name] = {o: range_sha256(f, o, n) for o, n in sorted(spans.items())}
    if world == 1:
        return mine
    parts: list = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return {name: d for part in parts if part for name, d in part.items()}


def _owner(name: str, world: int) -> int:
    match = _RANK_FILE.match(name)
    return int(match.group(1)) % world if match else 0


def _place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
