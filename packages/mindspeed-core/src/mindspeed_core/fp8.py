"""fp8 training of linear layers through torchao's float8 (`pip install 'mindspeed-core[fp8]'`).

`convert_fp8(model)` swaps, in place, every `nn.Linear` of `model` whose input and output
features are multiples of 16 (the fp8 GEMM's tile) and whose name is not skipped (the
output head, as torchtitan does) for torchao's `Float8Linear`: the weight stays a parameter
of its dtype under the same name; each forward casts input and weight to float8 e4m3 with one
dynamic scale per tensor (and the output gradient to e5m2 in the backward) and multiplies with
`torch._scaled_mm` (H100-class GPUs; recent PyTorch also runs it on CPU, which is how the
tests check it). Convert before any parallelism: FSDP2 then shards and gathers the weights of
`Float8Linear` like any other; tensor parallel would need torchao's float8 parallel styles,
which the decoder's plans do not use, so `mindspeed_llm` refuses fp8 with tp > 1.
"""

from __future__ import annotations

from torch import nn

from mindspeed_core.errors import ConfigError

__all__ = ["FP8_MULTIPLE", "convert_fp8"]

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
