"""Give a model built on the meta device its values, this rank's shards only, the same
values in every layout.

The start-up path of every command (torchtitan's, with one property kept from ours):

    with torch.device("meta"):
        model = build(config)            # no storage anywhere
    parallelize(model, dims)             # TP / EP / FSDP make DTensor parameters, still meta
    model.to_empty(device=device)        # this rank's shards, uninitialised
    init = ParamInit(model, seed)        # then fill them:
    init.normal(model.proj.weight, std=0.02)

`ParamInit` draws each parameter from a generator seeded by the run's seed and the
parameter's name, whole (or one expert at a time), on the device, and keeps the block this
rank holds (`local_box`), so a shard holds exactly what one process drew for those rows and
columns, whatever the layout, and no rank holds more than its shards plus one parameter.
Weights read from a checkpoint are written the same way (`write_box`): the reader is asked
for this rank's block only.

The names are the plain model's (`plain_name`: no activation-checkpoint or torch.compile
wrapper in them), so a pipeline stage draws its layers as the whole model would.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "Box",
    "ParamInit",
    "local_box",
    "materialize",
    "plain_name",
    "run_materialized_hooks",
    "seeded_generator",
    "write_box",
]

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")

Draw = Callable[[tuple[int, ...], torch.Generator, torch.device], Tensor]
"""`draw(shape, generator, device)`: a float32 tensor of `shape` drawn from `generator`."""


def plain_name(name: str) -> str:
    """A parameter name as the plain model spells it (no recompute or compile wrapper)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def seeded_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for `name` under the run's `seed`: what it draws does not depend
    on which other tensors a rank holds, or in which order they are drawn."""
    mixed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    return torch.Generator(device=device).manual_seed(mixed)


@dataclass(frozen=True)
class Box:
    """The block of a whole tensor one rank holds: `offsets` and `sizes` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def of(self, whole: Tensor) -> Tensor:
        """This block of `whole` (a view)."""
        return whole[self.slices()]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def local_box(tensor: Tensor) -> Box:
    """The block of the whole tensor that this rank's shard of `tensor` holds (all of it for
    a plain tensor). Every placement our layouts make (Shard, FSDP's strided shards over
    tensor-parallel shards, Replicate) gives one block, as DCP's chunk list says."""
    if not isinstance(tensor, DTensor):
        return Box((0,) * tensor.dim(), tuple(tensor.shape))
    (chunk,) = tensor.__create_chunk_list__()
    return Box(tuple(chunk.offsets), tuple(chunk.sizes))


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's storage of `tensor` (its local shard, or the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def write_box(param: Tensor, read: Callable[[Box], Tensor]) -> None:
    """Fill this rank's shard of `param` with `read(box)`: the whole tensor's block `box`,
    any dtype, any device (one call, so one block in memory at a time)."""
    local = local_tensor(param)
    if local.numel() == 0:
        return
    box = local_box(param)
    value = read(box)
    if tuple(value.shape) != box.sizes:
        raise ValueError(f"a block of {tuple(value.shape)} for a shard of {box.sizes}")
    local.copy_(value)


class ParamInit:
    """Fills the parameters of `root` (materialised, e.g. after `to_empty`), each from a
    generator of its own (`seeded_generator(seed, name)`), keeping this rank's block.

    Every method takes the parameter itself; its name is looked up in `root`. `skip` names
    parameters that are filled otherwise (read from a checkpoint): they are left alone.
    `finish` fills what no module asked for (layers a hook added: a classifier head, ...)
    by the rules of their module type, and refuses a parameter it has no rule for.
    """

    def __init__(self, root: nn.Module, seed: int, *, skip: Iterable[str] = ()):
        self.seed = int(seed)
        self.names: dict[int, str] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(param), plain_name(name))
        self.skip = set(skip)
        self.filled: set[int] = set()

    def name_of(self, param: Tensor) -> str:
        try:
            return self.names[id(param)]
        except KeyError:
            raise ValueError("ParamInit: a parameter that is not in the model") from None

    def is_filled(self, param: Tensor) -> bool:
        return id(param) in self.filled

    def draw(
        self,
        param: Tensor | None,
        draw: Draw,
        *,
        name: str | None = None,
        rows: int | None = None,
        per_row_block: bool = False,
    ) -> None:
        """Fill `param` with `draw` of its whole shape, keeping this rank's block.

        Args:
            name: the name to seed with (default: the parameter's own; a copy of a tied
                weight draws as the weight it copies).
            rows: only the first `rows` rows are drawn, the rest are zero (padding rows).
            per_row_block: each index of dim 0 is drawn on its own (stacked experts: a rank
                draws only the experts it holds).
        """
        if param is None:
            return
        own = self.name_of(param)
        self.filled.add(id(param))
        if own in self.skip:
            return
        name = name or own
        local = local_tensor(param)
        device = local.device

        def read(box: Box) -> Tensor:
            shape = tuple(param.shape)
            real = shape[0] if rows is None else min(rows, shape[0])
            out = torch.zeros(box.sizes, dtype=torch.float32, device=device)
            start, size = box.offsets[0], box.sizes[0]
            stop = min(start + size, real)
            if stop <= start:
                return out
            rest = Box(box.offsets[1:], box.sizes[1:])
            if per_row_block:
                for i in range(start, stop):
                    g = seeded_generator(self.seed, f"{name}.{i}", device)
                    out[i - start] = rest.of(draw(shape[1:], g, device))
            else:
                whole = draw((real, *shape[1:]), seeded_generator(self.seed, name, device), device)
                out[: stop - start] = whole[(slice(start, stop), *rest.slices())]
            return out

        if local.is_meta:
            raise ValueError(f"ParamInit: {own} is still on the meta device (call to_empty first)")
        write_box(param, read)

    def normal(self, param: Tensor | None, std: float, mean: float = 0.0, **kw) -> None:
        self.draw(param, _normal(mean, std), **kw)

    def uniform(self, param: Tensor | None, low: float, high: float, **kw) -> None:
        self.draw(param, _uniform(low, high), **kw)

    def constant(self, param: Tensor | None, value: float) -> None:
        """Fill with `value` (no generator: the same on every rank anyway)."""
        if param is None:
            return
        self.filled.add(id(param))
        if self.name_of(param) not in self.skip:
            with torch.no_grad():
                local_tensor(param).fill_(value)

    def finish(self, root: nn.Module) -> None:
        """Fill every parameter of `root` no module filled yet: a module with an
        `init_params(init)` method fills its own; `nn.Linear` as torch draws it (Kaiming
        uniform weight, uniform bias), `nn.Embedding` N(0, 1), `nn.LayerNorm` 1 and 0.

        Raises:
            ValueError: a parameter of another module type (give it `init_params`).
        """
        for module_name, module in root.named_modules():
            own = [p for _, p in module.named_parameters(recurse=False) if not self.is_filled(p)]
            if not own:
                continue
            if callable(getattr(module, "init_params", None)):
                module.init_params(self)
            elif isinstance(module, nn.Linear):
                self._linear(module)
            elif isinstance(module, nn.Embedding):
                self.normal(module.weight, 1.0)
            elif isinstance(module, nn.LayerNorm):
                self.constant(module.weight, 1.0)
                self.constant(module.bias, 0.0)
            left = [n for n, p in module.named_parameters(recurse=False) if not self.is_filled(p)]
            if left:
                where = f"{module_name}.{left[0]}" if module_name else left[0]
                raise ValueError(
                    f"no initialisation for parameter {where} ({type(module).__name__}): "
                    "give the module an init_params(init) method"
                )

    def _linear(self, linear: nn.Linear) -> None:
        bound = 1 / math.sqrt(linear.in_features) if linear.in_features else 0.0
        # kaiming_uniform_(a=sqrt(5)) as nn.Linear.reset_parameters: bound sqrt(6 / ((1 + 5) fan_in))
        self.uniform(linear.weight, -bound, bound)
        self.uniform(linear.bias, -bound, bound)


def _normal(mean: float, std: float) -> Draw:
    def draw(shape, generator, device):
        return torch.empty(shape, device=device).normal_(mean, std, generator=generator)

    return draw


def _uniform(low: float, high: float) -> Draw:
    def draw(shape, generator, device):
        return torch.empty(shape, device=device).uniform_(low, high, generator=generator)

    return draw


def materialize(
    module: nn.Module,
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """`module`, built on the meta device (and parallelised), given storage on `device`:
    this rank's shards only, uninitialised (fill them with `ParamInit` or `write_box`).
    `dtype` casts floating-point parameters and buffers first."""
    if dtype is not None:
        module.to(dtype)
    return module.to_empty(device=device)


def run_materialized_hooks(module: nn.Module) -> None:
    """Call (once) the `materialized_hook` a submodule set for when its values are in: work
    that needs them and so could not run on the meta device (QLoRA quantises its base)."""
    for sub in module.modules():
        hook = sub.__dict__.pop("materialized_hook", None)
        if hook is not None:
            hook()
