"""Activation checkpointing (recompute) per block, without changing parameter names.

- "full": keep only each block's input; recompute the whole block in backward.
- "selective": keep the outputs of matmuls, attention and reduce-scatters (the
  expensive ops), recompute the cheap elementwise ones (norms, activations,
  rotary), as torchtitan's op-level policy does.

Uses the composable `checkpoint` hook, so state-dict keys stay the same with and
without recompute and checkpoints move freely between the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel.blocks import find_blocks

AC_MODES = ("none", "full", "selective")
EXTRA_SAVED_OPS = ["mindspeed::attention_fwd"]
"""Custom ops that selective recompute keeps (by name: found when their library is loaded)."""


def _save_list() -> set:
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
    cudnn = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    if cudnn is not None:
        ops.add(cudnn.default)
    # mindspeed-ops' attention (packed, windowed, with lse), when that package is loaded: core
    # names it without importing it.
    for name in EXTRA_SAVED_OPS:
        namespace, _, op = name.partition("::")
        with contextlib.suppress(AttributeError, RuntimeError):
            ops.add(getattr(getattr(torch.ops, namespace), op).default)
    return ops


def _policy(save: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """The context pair that makes `checkpoint` keep matmul outputs only."""
    return create_selective_checkpoint_contexts(partial(_policy, _save_list()))


def apply_ac(
    module: nn.Module, mode: str = "full", *, blocks: Iterable[nn.Module] | str | None = None
) -> nn.Module:
    """Recompute activations of each block of `module` in backward.

    Args:
        mode: "none", "full" or "selective".
        blocks: see `find_blocks`.

    Raises:
        ParallelError: unknown mode.
    """
    if mode not in AC_MODES:
        raise ParallelError(f"activation checkpointing mode {mode!r}; choose one of {AC_MODES}")
    if mode == "none":
        return module
    for block in find_blocks(module, blocks):
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=selective_context_fn)
    return module
