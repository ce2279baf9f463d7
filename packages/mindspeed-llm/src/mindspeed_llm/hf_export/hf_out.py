"""Writing a Hugging Face folder's safetensors one tensor at a time.

`ShardedWriter` opens every planned shard file with its header written up front
(`SafetensorsWriter`), so tensors may arrive in any order and each is dropped once written;
`OursToHF` turns our tensors, as they arrive, into the family's Hugging Face tensors
(renamed at once, or computed once their layer's sources are all in: per-expert weights
from a stacked expert tensor, ...). Together they let `convert` write a model it never holds.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from mindspeed_core.checkpoint.safetensors import SafetensorsWriter
from mindspeed_llm.models import hf_io

Entries = list[tuple[str, torch.dtype, tuple[int, ...]]]
"""(name, dtype, shape) of each tensor to write, in the files' order."""


def plan_shards(entries: Entries, max_shard_size: int) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file at most `max_shard_size` (or one tensor)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {hf_io.SINGLE_FILE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


class ShardedWriter:
    """The planned `shards` of `entries` in `folder`, written as tensors arrive (any order),
    each cast to `dtype` when given. Leaving its `with` block closes the files: normally
    checking every tensor was written and writing the index when there are several; after
    a failure only closing them (the caller discards the folder)."""

    def __init__(
        self,
        folder: Path,
        entries: Entries,
        shards: dict[str, list[str]],
        dtype: torch.dtype | None,
    ):
        self.folder = folder
        self.dtype = dtype
        self.where = {name: file for file, names in shards.items() for name in names}
        self.writers = {}
        for file, names in shards.items():
            wanted = set(names)
            mine = [e for e in entries if e[0] in wanted]
            self.writers[file] = SafetensorsWriter(folder / file, mine)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self._close()
        else:
            self._abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        cast = tensor if self.dtype is None else tensor.to(self.dtype)
        self.writers[self.where[name]].write(name, cast)

    def _close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        if len(self.writers) > 1:
            index = {
                "metadata": {"total_size": sum(w.size for w in self.writers.values())},
                "weight_map": dict(sorted(self.where.items())),
            }
            (self.folder / hf_io.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def _abort(self) -> None:
        for writer in self.writers.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again
                writer.close(check=False)


class OursToHF:
    """Our tensors (`ours`: name -> dtype, shape) in, the family's Hugging Face tensors out,
    one at a time.

    A renamed tensor is written as it arrives; the tensors the adapter computes from several
    of ours (per-expert weights of a stacked expert tensor, ...) are made once all their
    sources of that layer are in, and a layer's sources are dropped once all its computed
    tensors are written. `shapes` (Hugging Face name -> dtype, shape, in the adapter's
    order) is known before any tensor arrives; `wanted` are the ours it needs.

    Raises:
        CheckpointError: the adapter reports missing or unexpected tensors.
    """

    def __init__(self, config, ours: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
        self._config = config
        self._meta = {n: torch.empty(s, dtype=d, device="meta") for n, (d, s) in ours.items()}
        self.shapes, renamed = hf_io.to_hf_plan(config, self._meta)
        self._names: dict[str, list[str]] = {}
        for hf, name in renamed.items():
            self._names.setdefault(name, []).append(hf)
        self._computed = len(renamed) < len(self.shapes)
        self.wanted = set(renamed.values()) | (set(ours) if self._computed else set())
        self._todo: dict[int | None, set[str]] = {}
        for hf in self.shapes:
            if hf not in renamed:
                self._todo.setdefault(hf_io.layer_of(hf), set()).add(hf)
        self._pending: dict[int | None, dict[str, torch.Tensor]] = {}

    def put(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Our tensor `name` has arrived: the Hugging Face tensors it completes."""
        for hf in self._names.get(name, ()):
            yield hf, tensor
        if not self._computed or name in self._names:
            return
        layer = hf_io.layer_of(name)
        sources = self._pending.setdefault(layer, {})
        sources[name] = tensor
        for hf, made in hf_io.to_hf_some(self._config, self._meta, sources).items():
            if hf in self._todo.get(layer, ()):
                self._todo[layer].discard(hf)
                yield hf, made
        if not self._todo.get(layer):
            self._pending.pop(layer)
