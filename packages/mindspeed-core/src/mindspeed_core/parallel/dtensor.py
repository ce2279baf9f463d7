"""Plain tensors from tensors that may be DTensors, the two ways code needs them.

`local(t)`: this rank's shard (no communication), e.g. to read a local shape or run a
kernel on the local part. `full(t)`: the whole value, gathered over the mesh (a
collective every rank of the mesh must call), e.g. a replicated loss or logits that
loss parallel left sharded over the vocabulary. Plain tensors pass through unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (`t` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t` on every rank (`t` itself when it is not a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
