"""fp8 training of linear layers through torchao's float8 (`pip install 'mindspeed-core[fp8]'`).

`convert_fp8(model)` swaps, in place, every `nn.Linear` of `model` whose input and output
features are multiples of 16 (the fp8 GEMM's tile) and whose name is not skipped (the
output head, as torchtitan does) for torchao's `Float8Linear`: the weight stays a parameter
of its dtype under the same name; each forward casts input and weight to float8 e4m3 with one
dynamic scale per tensor (and the output gradient to e5m2 in the backward) and multiplies with
`torch._scaled_mm` (H100-class GPUs; recent PyTorch also runs it on CPU, which is how the
tests check it). Convert before any parallelism: FSDP2 then shards and gathers the weights of
`Float8Linear` like any other. Under tensor parallel `float8_plan` turns a plan's column- and
row-wise styles of converted layers into torchao's float8 ones (`Float8ColwiseParallel`,
`Float8RowwiseParallel`: the input cast to float8 before the layer's sharded GEMM, the weight's
scale over every shard).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from mindspeed_core.errors import ConfigError

__all__ = ["FP8_MULTIPLE", "convert_fp8", "float8_plan"]

FP8_MULTIPLE = 16  # torch._scaled_mm needs both GEMM dims divisible by 16


def convert_fp8(model: nn.Module, *, skip: tuple[str, ...] = ("output",)) -> list[str]:
    """Swap the fp8-capable linear layers of `model` for torchao's `Float8Linear`, in place.

    Args:
        skip: last name components left in high precision (default: the output head).

    Returns:
        The qualified names of the converted layers.

    Raises:
        ConfigError: torchao is not installed, or no layer can be converted.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(
            "train.fp8 needs torchao: pip install 'mindspeed-core[fp8]'"
        ) from e
    converted: list[str] = []

    def eligible(module: nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and name.rsplit(".", 1)[-1] not in skip
            and module.in_features % FP8_MULTIPLE == 0
            and module.out_features % FP8_MULTIPLE == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=eligible)
    if not converted:
        raise ConfigError(
            f"train.fp8: no linear layer has input and output features divisible by "
            f"{FP8_MULTIPLE} (skipping {', '.join(skip)}); nothing would run in fp8"
        )
    return converted


def float8_plan(plan: dict[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """`plan` (module name patterns -> styles, as `apply_tp` takes) with each plain column- or
    row-wise style whose modules are all `Float8Linear` (`convert_fp8`) swapped for torchao's
    float8 style of the same layouts; every other entry as it was."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swaps = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        matched = [m for name, m in modules.items() if fnmatchcase(name, pattern)]
        kind = swaps.get(type(style))
        if kind is not None and matched and all(isinstance(m, Float8Linear) for m in matched):
            style = kind(input_layouts=style.input_layouts[0],
                         output_layouts=style.output_layouts[0],
                         use_local_output=style.use_local_output)  # fmt: skip
        out[pattern] = style
    return out
