"""The one batch contract of every trainer, built by data code, never by the trainer.

A batch is a dict of tensors::

    input_ids     (batch, seq) int64  the tokens the model reads
    labels        (batch, seq) int64  the token to predict at each position, aligned with
                                      input_ids (labels[:, t] follows input_ids[:, :t+1]);
                                      IGNORE_INDEX (-100) where nothing is supervised
    position_ids  (batch, seq) int64  RoPE positions (restarting per packed document)
    cu_seqlens    (docs + 1,)  int32  document boundaries over the flattened batch * seq
                                      tokens: 0 first, batch * seq last, and every row
                                      boundary among them (no document crosses rows)

A data source may add keys its objective reads (per-token weights, advantages...): a
tensor shaped like `input_ids` is per-token, and context parallel shards it with the rest.

Pretraining makes its batches with `lm_batch`; the trainer's step only regroups rows
(`concat_batches`, `split_batch`) and shards them for context parallel
(`shard_context_parallel`), whatever the objective.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from mindspeed_core.parallel import gather_tokens, packed_shard_index
from mindspeed_llm.data.packing import packed_positions
from mindspeed_llm.models.common.attention import SharedKeys
from mindspeed_ops.validate import carry_host_values, remember_host_values

IGNORE_INDEX = -100
"""The label of a position that is not supervised (torch's and transformers' default)."""
BATCH_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens")
Batch = dict[str, Tensor]

__all__ = [
    "forward_packed",
    "BATCH_KEYS",
    "IGNORE_INDEX",
    "Batch",
    "check_batch",
    "concat_batches",
    "lm_batch",
    "shard_context_parallel",
    "split_batch",
    "to_device",
]


def lm_batch(
    samples: Tensor,
    eod_id: int | None,
    *,
    reset_position_ids: bool = True,
    reset_attention_mask: bool = True,
) -> Batch:
    """Pretraining: (batch, seq + 1) token blocks -> inputs, shifted labels, positions and
    document boundaries (documents end at `eod_id`; None: one document per row)."""
    input_ids = samples[:, :-1]
    position_ids, cu_seqlens = packed_positions(
        input_ids,
        -1 if eod_id is None else eod_id,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
    )
    return {
        "input_ids": input_ids,
        "labels": samples[:, 1:],
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
    }


SHARED_KEYS = ("kv_index", "cu_seqlens_k", "kv_offsets")
"""A batch whose replies share their prompts (`models.common.attention.SharedKeys`) holds
these too: the flat token of each key, the keys' documents, each document's offset."""


def forward_packed(model, batch: Batch, **kwargs):
    """`model` on a packed batch: its tokens, positions and document boundaries (`kwargs`
    go to the model as well); a batch with shared prompts gives them as `SharedKeys`."""
    cu_seqlens = batch["cu_seqlens"]
    if SHARED_KEYS[0] in batch:
        cu_seqlens = SharedKeys(cu_seqlens, *(batch[k] for k in SHARED_KEYS))
    return model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=cu_seqlens,
                 **kwargs)  # fmt: skip


BOUNDARY_KEYS = ("cu_seqlens", "cu_seqlens_k", "kv_offsets")
"""Index tensors the attention kernels read on the host (document boundaries, offsets)."""


def to_device(tensors: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """`tensors` (a batch, an objective's targets) on `device`, without making the host wait:
    the copies are non-blocking (a blocking copy to an accelerator waits for every kernel
    queued before it), and the values of the document boundaries are remembered from their
    host copies (`mindspeed_ops.validate.remember_host_values`), so the kernels that need them
    on the host never read them back from the device. Host tensors are copied on a CPU
    device too, so the host batch and the step's stay apart as on an accelerator (a test
    counting syncs, `mindspeed_core.testing.HostSyncs`, tells them apart; a few kB a step).
    Tensors already on an accelerator stay as they are."""
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, Tensor) or value.device.type != "cpu":
            out[key] = value
            continue
        if key in BOUNDARY_KEYS:
            remember_host_values(value)  # a host tensor: reading it waits for nothing
        moved = value.to(device, non_blocking=True, copy=value.device == device)
        out[key] = carry_host_values(value, moved)
    return out


def check_batch(batch: Batch) -> None:
    """Raise ValueError naming what breaks the contract (a data source's bug)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; a batch holds {list(BATCH_KEYS)}")
    shape = tuple(batch["input_ids"].shape)
    for key in ("labels", "position_ids"):
        if tuple(batch[key].shape) != shape or len(shape) != 2:
            raise ValueError(f"batch[{key!r}] is {tuple(batch[key].shape)}, input_ids {shape}")
    cu = batch["cu_seqlens"].tolist()
    rows, seq = shape
    if cu[0] != 0 or cu[-1] != rows * seq or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens {cu} must rise from 0 to batch * seq = {rows * seq}")
    if not set(range(0, rows * seq, seq)) <= set(cu):
        raise ValueError(f"cu_seqlens {cu} must hold every row boundary (multiples of {seq})")


def concat_batches(batches: list[Batch]) -> Batch:
    """The rows of `batches`, one after the other, as one batch."""
    if len(batches) == 1:
        return batches[0]
    out = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k != "cu_seqlens"}
    offset, bounds = 0, [batches[0]["cu_seqlens"][:1]]
    for b in batches:
        bounds.append(b["cu_seqlens"][1:] + offset)
        offset += b["input_ids"].numel()
    out["cu_seqlens"] = torch.cat(bounds).to(torch.int32)
    return out


def split_batch(batch: Batch, n: int) -> list[Batch]:
    """`n` batches of equal rows, in order (the rows must divide by `n`)."""
    rows, seq = batch["input_ids"].shape
    if rows % n:
        raise ValueError(f"{rows} rows do not split into {n} equal batches")
    if n == 1:
        return [batch]
    size, cu = rows // n, batch["cu_seqlens"]
    out = []
    for i in range(n):
        start, end = i * size * seq, (i + 1) * size * seq
        part = {k: v[i * size : (i + 1) * size] for k, v in batch.items() if k != "cu_seqlens"}
        part["cu_seqlens"] = (cu[(cu >= start) & (cu <= end)] - start).to(torch.int32)
        out.append(part)
    return out


def shard_context_parallel(
    batch: Batch, cp_rank: int, cp: int, *others: dict[str, Tensor]
) -> tuple[Batch, ...]:
    """This context-parallel rank's zig-zag share of every document, as one row.

    Each document is padded to a multiple of 2 x cp (labels IGNORE_INDEX, other per-token
    tensors 0) and rank r keeps its chunks r and 2cp-1-r, at their global positions
    (`mindspeed_core.parallel.packed_shard_index`); cu_seqlens become the local ones.
    `others` (an objective's targets) are sharded the same way. Tensors not shaped like
    input_ids pass through unchanged.

    Returns:
        (the local batch, *the local others)
    """
    shape = batch["input_ids"].shape
    index, local_cu = packed_shard_index(batch["cu_seqlens"], cp_rank, cp)

    def shard(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for key, value in tensors.items():
            if value.shape == shape:
                pad = IGNORE_INDEX if key == "labels" else 0
                value = gather_tokens(value.flatten(), index, pad)[None]
            out[key] = value
        return out

    return ({**shard(batch), "cu_seqlens": local_cu}, *(shard(t) for t in others))
