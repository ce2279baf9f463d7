"""torch.compile per block (torchtitan's approach), with parameter names unchanged.

Each block's `forward` is compiled on its own: the blocks share one code object, so one
graph serves them all (Dynamo inlines the module and takes its parameters as inputs).
Apply after tensor parallel and activation checkpointing, before FSDP, as torchtitan
does. Unlike torchtitan we compile `forward`, not the module's call: the composable
recompute (`apply_ac`) and FSDP2 act through module hooks, which then run eagerly around
the compiled graph instead of being traced (Dynamo cannot trace the recompute hooks'
context manager), and the block is not wrapped, so state-dict names gain no `_orig_mod`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from mindspeed_core.parallel.blocks import find_blocks


def apply_compile(
    module: nn.Module,
    *,
    blocks: Iterable[nn.Module] | str | None = None,
    fullgraph: bool = True,
    backend: str = "inductor",
    dynamic: bool | None = None,
    varying: Mapping[str, int] | None = None,
    mode: str | None = None,
) -> nn.Module:
    """Compile the `forward` of each block of `module` in place.

    Args:
        blocks: see `find_blocks`.
        fullgraph: refuse graph breaks (an error at the first call rather than a silently
            split block).
        backend: torch.compile's backend ("inductor"; "aot_eager" to debug).
        dynamic: torch.compile's `dynamic` (True for decoding, where the cached length
            grows every step: one graph for all steps instead of one per length).
        varying: keyword arguments of the blocks' forward whose given dim changes from
            call to call ({"cu_seqlens": 0}: the packed documents of a batch): compiled
            with that size symbolic from the first call, so a new length reuses the graph
            instead of compiling the block again.
        mode: torch.compile's `mode` ("reduce-overhead": the blocks replayed as CUDA graphs).
    """
    for block in find_blocks(module, blocks):
        # An instance attribute shadows the class's forward; nn.Module.__call__ keeps
        # running the block's hooks (recompute, FSDP) around it, uncompiled.
        compiled = torch.compile(block.forward, fullgraph=fullgraph, backend=backend,
                                 dynamic=dynamic, mode=mode)  # fmt: skip
        call = functools.partial(_settled_call, compiled, dict(varying or {}))
        block.forward = functools.wraps(compiled)(call)
    return module


def _settled_call(compiled, varying, *args, **kwargs):
    """`compiled(*args, **kwargs)` with in-flight collective results settled first.

    Tensor parallel's embedding returns the result of an async all-reduce as an
    `AsyncCollectiveTensor`; given one as an input, a compiled graph's backward hands a plain
    tensor to the redistribution before it (torch 2.14: "'Tensor' object has no attribute
    '_local_tensor'"). A copy made eagerly waits for the collective and keeps the autograd
    edge; it happens only for such inputs (the first block's, once per micro-batch).
    """
    args = tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)
    for name, dim in varying.items():
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(value, dim)
    return compiled(*args, **kwargs)


def is_compiled(block: nn.Module) -> bool:
    """Whether `apply_compile` compiled this block."""
    return "forward" in vars(block)
