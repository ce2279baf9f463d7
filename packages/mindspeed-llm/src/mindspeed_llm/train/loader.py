"""Micro-batches for each data-parallel rank, resumable from a sample count.

Megatron's pretraining sampler: step after step, the global batch is the next
`global_batch` samples of the dataset; each rank takes its slice of every
micro-batch group. The position is one number, the samples consumed, so a resumed
run (even with another data-parallel degree) sees exactly the samples an
uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful


class PretrainLoader(Stateful):
    """Yields this rank's micro-batches: (batch, seq + 1) int64 token tensors, or what
    `collate` makes of them (`next_batch`).

    Args:
        dataset: indexable, `dataset[i]["tokens"]` is a (seq + 1,) array.
        micro_batch: samples per micro-batch on this rank.
        dp_rank / dp_size: this rank's place among the data-parallel ranks.
        collate: (batch, seq + 1) tokens -> a batch (see `mindspeed_llm.data.collate`).
    """

    def __init__(
        self,
        dataset,
        *,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        collate: Callable[[torch.Tensor], Any] | None = None,
    ):
        self.dataset = dataset
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.collate = collate
        self.consumed = 0

    def next_micro_batch(self) -> torch.Tensor:
        """The next micro-batch of this rank; advances by one micro-batch of every rank."""
        start = self.consumed + self.dp_rank * self.micro_batch
        rows = [self._sample(start + j) for j in range(self.micro_batch)]
        self.consumed += self.micro_batch * self.dp_size
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def next_batch(self):
        """The next micro-batch, collated."""
        return self.collate(self.next_micro_batch())

    def _sample(self, index: int) -> np.ndarray:
        return np.asarray(self.dataset[index % len(self.dataset)]["tokens"])

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = int(state_dict["consumed_samples"])
