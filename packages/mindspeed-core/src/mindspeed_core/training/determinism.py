"""Seeding per mesh axis, and the switch to deterministic kernels.

Ranks that must draw the same random numbers share a seed; ranks that must differ
get different ones. `set_seed(seed, dims, vary_along=...)` offsets the seed by this
rank's coordinate along each axis in `vary_along` only:

- the default ``("pp",)`` matches Megatron-LM: each pipeline stage initialises its
  own layers differently, while tensor-parallel and data-parallel ranks agree (so
  replicated weights start equal and every tp rank sees the same data order);
- add ``"tp"`` for dropout on activations that tensor parallel splits, ``"dp"`` for
  independent dropout masks per data shard.

DTensor random ops (dropout on a sharded DTensor) already give each shard its own
slice of one random stream, as long as the ranks of the mesh start from the same
seed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import numpy as np
import torch

from mindspeed_core.parallel.dims import ParallelDims

_STRIDE = 1_000_003  # a prime: distinct coordinates never collide for realistic degrees


def derive_seed(seed: int, dims: ParallelDims | None, vary_along: Sequence[str]) -> int:
    """`seed` offset by this rank's coordinates along the axes in `vary_along`."""
    offset = 0
    for i, axis in enumerate(vary_along):
        if dims is not None:
            offset += dims.rank(axis) * _STRIDE ** (i + 1)
    return (seed + offset) % 2**63


def set_seed(
    seed: int,
    dims: ParallelDims | None = None,
    *,
    vary_along: Sequence[str] = ("pp",),
    deterministic: bool = False,
) -> int:
    """Seed Python, NumPy and torch (all devices); returns the seed this rank used."""
    local = derive_seed(seed, dims, vary_along)
    random.seed(local)
    np.random.seed(local % 2**32)
    torch.manual_seed(local)  # seeds every accelerator's default generator too
    if deterministic:
        enable_determinism()
    return local


def enable_determinism() -> None:
    """Deterministic kernels where the device has them (some ops then raise)."""
    # cuBLAS needs a fixed workspace to be reproducible; harmless elsewhere.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
