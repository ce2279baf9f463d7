"""Counting the host syncs of a piece of code, on any device, CPU included.

On an accelerator, reading a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`,
`if t:`) or running an op whose output shape depends on values (`nonzero`, a boolean index)
waits for every kernel queued before it: the host stops running ahead of the device. A training
step that does that once per layer is bound by its Python. On CPU the same code waits for
nothing, so a test there cannot time it; it can count it.

`HostSyncs` follows where each tensor's values live. Tensors handed to it as `host` (the data
loader's batches, which stay in host memory) and what is computed from them alone on the CPU
are host data: reading them costs nothing. Everything else is device data: the model's weights
and activations, and a batch once moved with `.to(device)` (on CPU the same object: from that
call on it counts as moved). Factory tensors (`torch.zeros`, `torch.tensor`) join the side of
what they are combined with, and count as device data when read alone. What happens inside a
custom op's body (`torch.library.custom_op`) is not seen.

    with HostSyncs(host=batch.values()) as syncs:
        step(batch)
    assert not syncs.reads, syncs.report()
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["HostSyncs"]

HOST, NEUTRAL = "host", "neutral"  # and, for anything not marked, the device

aten = torch.ops.aten
_READS = {aten._local_scalar_dense, aten.equal, aten.is_nonzero}
"""Ops that return a value on the host."""
_VALUE_SHAPED = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
                 aten.unique_dim, aten.unique_consecutive, aten.bincount}  # fmt: skip
"""Ops whose output shape depends on the values (the host waits to learn it)."""
_METHODS = {"tolist", "numpy", "__array__"}
"""Tensor methods that read values without dispatching an op on CPU."""


class HostSyncs:
    """A context manager counting host syncs; see the module docstring.

    Attributes:
        reads: one entry per sync: the op or method, and the innermost frame of our code
            that ran it.
    """

    def __init__(self, host: Iterable[torch.Tensor] = ()):
        self.where = WeakTensorKeyDictionary()
        for t in host:
            self.where[t] = HOST
        self.reads: list[str] = []
        self._modes = (_Functions(self), _Dispatch(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def report(self) -> str:
        return f"{len(self.reads)} host syncs:\n" + "\n".join(self.reads)

    def side(self, t: torch.Tensor) -> str:
        return self.where.get(t, "device")

    def note(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-3] if "mindspeed" in f.filename
                  and "testing/syncs.py" not in f.filename]  # fmt: skip
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.reads.append(f"{what} at {where}")


class _Functions(TorchFunctionMode):
    """Methods that read without dispatching (tolist), and moves to a device (`.to`)."""

    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reads = name in _METHODS and args and isinstance(args[0], torch.Tensor)
        if reads and self.owner.side(args[0]) != HOST:
            self.owner.note(f"Tensor.{name}")
        out = func(*args, **kwargs)
        if name in ("to", "cuda", "npu") and isinstance(out, torch.Tensor):
            options = {k: v for k, v in kwargs.items() if k != "copy"}
            device = torch._C._nn._parse_to(*args[1:], **options)[0] if name == "to" else name
            if device is not None:
                self.owner.where[out] = "device"
        return out


class _Dispatch(TorchDispatchMode):
    """Reads and value-shaped ops on device data; where each op's outputs live."""

    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sides = {self.owner.side(t) for t in inputs}
        side = (HOST if sides <= {HOST, NEUTRAL} and HOST in sides else
                NEUTRAL if not inputs or sides == {NEUTRAL} else "device")  # fmt: skip
        packet = func.overloadpacket
        if side != HOST and _syncs(packet, func, args, kwargs):
            self.owner.note(str(func))
        out = func(*args, **kwargs)
        if packet in (aten._to_copy, aten.copy_) and _leaves_the_host(args, kwargs):
            side = "device"
        for t in tree_flatten(out)[0]:  # an in-place op's output takes its inputs' side too
            if isinstance(t, torch.Tensor):
                self.owner.where[t] = side
        return out


def _syncs(packet, func, args, kwargs) -> bool:
    if packet in _READS or packet in _VALUE_SHAPED:
        return True
    if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None and (len(args) < 2 or args[-1] is None)
    if packet in (aten.index, aten.index_put, aten.index_put_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet in (aten._to_copy, aten.copy_):  # device -> host copies wait for the device
        src = args[1] if packet is aten.copy_ else args[0]
        dst = args[0].device if packet is aten.copy_ else kwargs.get("device")
        return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    return False


def _leaves_the_host(args, kwargs) -> bool:
    """A `_to_copy` to an explicit device, or a `copy_` into a non-CPU tensor."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return bool(args) and args[0].device.type != "cpu" and len(args) > 1
