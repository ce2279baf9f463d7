"""Which submodules are a model's repeated blocks (the unit of FSDP and recompute)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from mindspeed_core.errors import ParallelError


def find_blocks(
    module: nn.Module, blocks: Iterable[nn.Module] | str | None, *, default_attr: str = "layers"
) -> list[nn.Module]:
    """The blocks of `module`.

    Args:
        blocks: the blocks themselves, the name of a ModuleList/ModuleDict attribute
            holding them, or None for ``module.<default_attr>``.
        default_attr: the attribute to look in when `blocks` is None (torchtitan's
            convention, ``layers``).

    Raises:
        ParallelError: no blocks can be found.
    """
    if blocks is None or isinstance(blocks, str):
        attr = blocks or default_attr
        container = getattr(module, attr, None)
        if not isinstance(container, nn.ModuleList | nn.ModuleDict):
            raise ParallelError(
                f"{type(module).__name__} has no ModuleList/ModuleDict attribute {attr!r}; "
                "pass blocks= (the submodules to wrap one by one)"
            )
        # Pipeline stages may set a block to None to drop it from this stage.
        values = container.values() if isinstance(container, nn.ModuleDict) else container
        return [b for b in values if b is not None]
    return list(blocks)
