"""Where a preference run's reference log-probs come from, besides a frozen copy of the model.

- `AdaptersOff(policy)`: a LoRA run's reference is its own base: the policy module called with
  every adapter bypassed (`mindspeed_llm.peft.adapters_disabled`), so no second copy of the
  weights exists.
- `precompute_reference(data, reference, ctx, ...)`: `dpo.ref: precompute`: one pass of the
  reference over every training (and validation) pair before step 1; each pair then carries its
  two log-probs (`RefPair.ref`), the data source puts them in the batch per token (`REF_KEY`), and the
  reference model can be dropped. The values are cached as `ref-<key>.pt` in the data cache
  folder, keyed by a hash of the encoded pairs and the reference's weights, written atomically
  by each machine's local rank 0 (the folder may be shared or local to each machine) and read
  back by a resumed run (or any run with the same data and reference).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mindspeed_align.logps import SLOT_KEY, Pair, frozen_sequence_logps, pack_pairs
from mindspeed_core.errors import disk_full_error, is_disk_full
from mindspeed_core.parallel import dtensor
from mindspeed_llm.data.collate import IGNORE_INDEX
from mindspeed_llm.peft import adapters_disabled

__all__ = ["REF_KEY", "AdaptersOff", "RefPair", "precompute_reference", "put_ref_logps"]

logger = logging.getLogger("mindspeed.dpo")

REF_KEY = "ref_logps"
"""The batch key of precomputed reference log-probs, per token: each sequence's value on its
first token, 0 elsewhere (`put_ref_logps`), so it follows its tokens through pipeline re-splits
and context-parallel sharding."""


class AdaptersOff(nn.Module):
    """The base model under a LoRA policy: `policy` called with its adapters bypassed."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):
        with torch.no_grad(), adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)


class RefPair(tuple):
    """A pair (chosen, rejected) that carries its reference log-probs in `.ref`."""

    def __new__(cls, pair: Pair, ref: tuple[float, float]):
        obj = super().__new__(cls, pair)
        obj.ref = ref
        return obj


def precompute_reference(data, reference: nn.Module, ctx, *, device, micro_pairs: int,
                         cache_dir: Path, fused: bool = False) -> Path:  # fmt: skip
    """Give every training and validation pair of `data` (a `PairData`) its reference
    log-probs, computed by `reference` or read from the cache; returns the cache file.
    `fused`: the replies' log-probs from the fused linear + cross entropy (no logits;
    `logps.frozen_sequence_logps`), where the layout leaves the output layer whole.

    Every rank runs the same forwards (tensor-parallel ranks must, the others simply do).
    """
    pairs = list(data.train) + list(data.valid)
    path = cache_dir / f"ref-{_key(pairs, reference)}.pt"
    values = _read(path, 2 * len(pairs))
    if not _everywhere(values is not None, device):  # every rank runs the forwards, or none
        values = None
    if values is None:
        values = _compute(pairs, reference, ctx, device, micro_pairs, data.seq_len, data.pad_id,
                          fused)  # fmt: skip
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one writer per machine: a cache
            _write(path, values)  # folder local to each machine fills on every machine
        logger.info("reference log-probs of %d pairs computed and cached in %s", len(pairs), path)
    else:
        logger.info("reference log-probs of %d pairs read from %s", len(pairs), path)
    out = [
        RefPair(p, (float(values[2 * i]), float(values[2 * i + 1]))) for i, p in enumerate(pairs)
    ]
    data.set_samples(out[: len(data.train)], out[len(data.train) :])
    return path


def put_ref_logps(batch: dict, group: Sequence[RefPair]) -> None:
    """`batch[REF_KEY]`: per token, each sequence's reference log-prob on its first token
    (0 elsewhere), so it follows its tokens wherever the rows go; nothing when the pairs
    carry no log-probs."""
    if not group or not all(isinstance(p, RefPair) for p in group):
        return
    slots = batch[SLOT_KEY]
    values = torch.tensor([v for p in group for v in p.ref], dtype=torch.float32)
    flat, out = slots.flatten(), torch.zeros(slots.numel(), dtype=torch.float32)
    local = flat - int(flat[flat >= 0].min()) if (flat >= 0).any() else flat
    first = torch.ones_like(flat, dtype=torch.bool)
    first[1:] = flat[1:] != flat[:-1]
    where = first & (flat >= 0)
    out[where] = values[local[where]]
    batch[REF_KEY] = out.view_as(slots)


def _everywhere(flag: bool, device) -> bool:
    """Whether `flag` holds on every rank."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


@torch.no_grad()
def _compute(pairs, reference, ctx, device, micro_pairs, seq_len, pad_id, fused) -> torch.Tensor:
    out = []
    was_training = reference.training
    reference.eval()
    try:
        for start in range(0, len(pairs), micro_pairs):
            chunk = pairs[start : start + micro_pairs]
            batch = {k: v.to(device) for k, v in pack_pairs(chunk, seq_len, pad_id).items()}
            keep = batch["labels"] != IGNORE_INDEX if fused else None
            logps = frozen_sequence_logps(reference, batch, batch[SLOT_KEY], 2 * len(chunk), ctx,
                                          keep=keep, fused=fused)  # fmt: skip
            out.append(logps.float().cpu())
    finally:
        reference.train(was_training)
    return torch.cat(out)


def _key(pairs: Sequence[Pair], reference: nn.Module) -> str:
    """sha256 of the encoded pairs (ids and labels) and of the reference's weights."""
    h = hashlib.sha256()
    for pair in pairs:
        for ids, labels in pair:
            h.update(ids.tobytes())
            h.update(labels.tobytes())
    for name, tensor in sorted(reference.state_dict().items()):
        h.update(name.encode())
        h.update(
            dtensor.full(tensor).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        )
    return h.hexdigest()[:24]


CACHE_VERSION = 2
"""Of the cache file: {"version", "values" (fp32 log-probs), "sha256" of the values}."""


def _digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.float().contiguous().numpy().tobytes()).hexdigest()


def _read(path: Path, expected: int) -> torch.Tensor | None:
    """The cached log-probs, or None when there is no file or it fails a check (unreadable,
    another version, a checksum or a count that does not match: one warning, then the caller
    computes them again). Loaded with weights_only: a file that would run code is refused."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        values = saved["values"] if isinstance(saved, dict) else None
        if not isinstance(saved, dict) or saved.get("version") != CACHE_VERSION:
            raise ValueError(f"not a version-{CACHE_VERSION} cache")
        if not isinstance(values, torch.Tensor) or values.shape != (expected,):
            raise ValueError(f"it does not hold {expected} log-probs")
        if saved.get("sha256") != _digest(values):
            raise ValueError("its checksum does not match")
    except Exception as err:  # unpickling, zip, key or check errors: any unusable cache
        logger.warning("computing the reference log-probs again: the cache %s cannot be used "
                       "(%s: %s)", path, type(err).__name__, err)  # fmt: skip
        return None
    return values


def _write(path: Path, values: torch.Tensor) -> None:
    """Atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # shared folders
    try:
        saved = {"version": CACHE_VERSION, "values": values.float(), "sha256": _digest(values)}
        torch.save(saved, tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if is_disk_full(err):
            raise disk_full_error(path, values.numel() * 4) from None
        raise
