"""Activation offload: what each block saves for backward waits in host memory.

`offload_activations(model)` wraps every block's forward in
`torch.autograd.graph.saved_tensors_hooks`: a saved tensor (not a parameter, at least
`min_bytes`) is copied to pinned host memory on a side stream as it is saved, and its
device copy is freed once the block's forward no longer needs it. In backward, the first
time a block needs one of its tensors, all of them come back (waiting for the copy), and
the block before it starts coming back on the side stream at once (prefetch), so the copy
overlaps the block's backward. Values are copied bit for bit: losses and gradients equal
those without offload.

Apply it last (after TP, FSDP: their forward hooks must run first, so FSDP's gathered
parameters are recognised as parameters and never offloaded). Not combined with
recompute: a recomputed block keeps nothing to offload.

On a CPU-only model the host *is* the device, so offloading saves nothing; it is refused
unless `allow_cpu=True` (tests use it to check the values round-trip exactly).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mindspeed_core import device as dev
from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel.blocks import find_blocks


@dataclass
class OffloadStats:
    """What went to host memory in the last forward (for tests and logs)."""

    tensors: int = 0
    bytes: int = 0


@dataclass
class _Packed:
    host: torch.Tensor
    device: torch.device
    event: object | None = None  # the last copy's completion (None: done, or CPU)
    back: torch.Tensor | None = None  # the device copy once it is coming back
    uses: int = 1  # saves of this very tensor (one copy serves them all)
    used: bool = False  # handed to autograd for the last time (which then owns it)
    dtensor: tuple | None = None  # (mesh, placements, shape, stride) of a DTensor


@dataclass
class _BlockStore:
    packed: list[_Packed] = field(default_factory=list)
    # (storage, offset, shape, stride, dtype) -> (packed, the tensor): holding the tensor
    # keeps its address from being reused by another one during the block's forward
    by_view: dict = field(default_factory=dict)
    previous: _BlockStore | None = None  # the block that ran before this one


class ActivationOffload:
    """The hooks of one model; `stats` counts the last forward."""

    def __init__(self, min_bytes: int, device: torch.device):
        self.min_bytes = min_bytes
        self.device = device
        self.stream = dev.new_stream(device)
        self.stats = OffloadStats()
        self._last: _BlockStore | None = None
        self._param_ptrs: set[int] = set()
        self._hooks: list = []  # the open saved_tensors_hooks context (blocks do not nest)

    def forward_pre_hook(self, block: nn.Module, args) -> None:
        store = _BlockStore(previous=self._last)
        self._last = store
        self._param_ptrs = {_storage_ptr(p) for p in block.parameters()}
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, store), lambda p: self._unpack(p, store)
        )
        hooks.__enter__()
        self._hooks.append(hooks)

    def forward_hook(self, block: nn.Module, args, output) -> None:
        self._hooks.pop().__exit__(None, None, None)
        self._last.by_view.clear()  # the device tensors may go now

    def reset(self) -> None:
        """Called at the start of each forward of the whole model."""
        self._last = None
        self.stats = OffloadStats()

    def _pack(self, t: torch.Tensor, store: _BlockStore):
        local = t.to_local() if isinstance(t, DTensor) else t
        if (
            isinstance(t, nn.Parameter)
            or _storage_ptr(local) in self._param_ptrs
            or local.numel() * local.element_size() < self.min_bytes
        ):
            return t  # kept as is
        view = (_storage_ptr(local), local.storage_offset(), local.shape, local.stride(), local.dtype)
        if view in store.by_view:  # the same tensor saved again (e.g. by wq, wk and wv)
            store.by_view[view][0].uses += 1
            return store.by_view[view][0]
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                           pin_memory=local.device.type != "cpu")  # fmt: skip
        event = dev.copy_on_stream(host, local, self.stream)
        meta = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        packed = _Packed(host=host, device=local.device, event=event, dtensor=meta)
        store.packed.append(packed)
        store.by_view[view] = (packed, local)
        self.stats.tensors += 1
        self.stats.bytes += host.numel() * host.element_size()
        return packed

    def _unpack(self, packed, store: _BlockStore) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if packed.back is None:
            self._bring_back(store)
            if store.previous is not None:  # the block whose backward runs next: prefetch
                self._bring_back(store.previous)
        dev.wait_event(packed.event, self.device)
        out = packed.back
        packed.uses -= 1
        if packed.uses == 0:  # autograd owns the device copy now; the host copy may go
            packed.back, packed.host, packed.used = None, None, True
        if packed.dtensor is not None:
            mesh, placements, shape, stride = packed.dtensor
            out = DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)
        return out

    def _bring_back(self, store: _BlockStore) -> None:
        for p in store.packed:
            if p.back is None and not p.used:  # same stream: after its device-to-host copy
                p.back = torch.empty(p.host.shape, dtype=p.host.dtype, device=p.device)
                p.event = dev.copy_on_stream(p.back, p.host, self.stream)


def offload_activations(
    model: nn.Module,
    *,
    blocks: Iterable[nn.Module] | str | None = None,
    min_bytes: int = 1024,
    allow_cpu: bool = False,
) -> ActivationOffload:
    """Offload the saved activations of each block of `model` to host memory.

    Args:
        blocks: see `mindspeed_core.parallel.find_blocks` (default: the `layers`).
        min_bytes: smaller tensors stay where they are (copies would cost more).
        allow_cpu: accept a model on the CPU (the copies go to the same memory).

    Returns:
        The hooks object; its `stats` say what the last forward offloaded.

    Raises:
        ParallelError: a model on the CPU without `allow_cpu`, or blocks that recompute.
    """
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if isinstance(param, DTensor):
        device = param.to_local().device
    if device.type == "cpu" and not allow_cpu:
        raise ParallelError(
            "activation offload moves activations from an accelerator to host memory; "
            "this model is already on the CPU"
        )
    offload = ActivationOffload(min_bytes, device)
    found = list(find_blocks(model, blocks))
    for block in found:
        if _recomputes(block):
            raise ParallelError(
                "activation offload with recompute (ac full/selective): a recomputed block "
                "keeps nothing to offload; choose one of the two"
            )
        block.register_forward_pre_hook(offload.forward_pre_hook)
        block.register_forward_hook(offload.forward_hook)
    model.register_forward_pre_hook(lambda module, args: offload.reset())
    return offload


def _recomputes(block: nn.Module) -> bool:
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(block) or {}
    return "checkpoint" in registry


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()
