"""NF4: QLoRA's 4-bit NormalFloat quantisation of frozen weights (Dettmers et al., 2023).

`nf4_quantize(x)` splits the flattened tensor into blocks of `block_size` values (64), keeps
each block's absmax in fp32 and replaces every value by the index of the nearest of 16
levels (quantiles of N(0, 1) scaled to [-1, 1]) to value / absmax, the first on a tie; two
indices share a byte, the first in the high nibble (torchao's layout). Storage is 0.5 byte
per value + 4 bytes per block: 0.28x bf16 at block 64. `nf4_dequantize` gives level x
absmax back in the requested dtype. The C++ CPU kernel and the reference are bit-identical;
CUDA and NPU run the reference's composed torch ops on the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import resolve_impl

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NF4 levels (bitsandbytes' table, as fp32)."""
_CPP_DTYPES = (torch.float32, torch.bfloat16)
_CHUNK = 1 << 16  # values per step of the reference (its [n, 16] distance matrix)


def _levels(device) -> Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def nf4_quantize_reference(x: Tensor, block_size: int = 64) -> tuple[Tensor, Tensor]:
    """The oracle: (packed uint8 codes [numel / 2], absmax fp32 [numel / block_size])."""
    blocks = x.detach().reshape(-1, block_size).float()
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks / absmax.unsqueeze(1)).flatten()
    scaled = torch.where(absmax.repeat_interleave(block_size) == 0, 0.0, scaled)
    levels = _levels(x.device)
    codes = torch.cat(
        [(c.unsqueeze(1) - levels).abs().argmin(dim=1) for c in scaled.split(_CHUNK)]
    ).to(torch.uint8)
    return codes[0::2] << 4 | codes[1::2], absmax


def nf4_dequantize_reference(
    packed: Tensor, absmax: Tensor, shape, dtype=torch.bfloat16, block_size: int = 64
) -> Tensor:
    """The oracle: level x absmax, computed in fp32, in `dtype` and `shape`."""
    codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten().long()
    values = _levels(packed.device)[codes].view(-1, block_size) * absmax.unsqueeze(1)
    return values.to(dtype).view(shape)


def _check(x: Tensor, block_size: int) -> None:
    if not x.is_floating_point():
        raise TypeError(f"nf4_quantize: x must be a floating tensor, got {x.dtype}")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"nf4: block_size must be positive and even, got {block_size}")
    if x.numel() % block_size:
        raise ValueError(
            f"nf4_quantize: block_size={block_size} does not divide x's {x.numel()} values"
        )


def _cpp(t: Tensor, backend: str, dtype: torch.dtype):
    if backend == "cpu" and dtype in _CPP_DTYPES:
        return cpu_ext.load()
    return None


def nf4_quantize(x: Tensor, *, block_size: int = 64, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """(packed uint8 codes [numel / 2], absmax fp32 [numel / block_size]) of `x`.

    Raises:
        TypeError: x is not floating; ValueError: block_size is odd or does not divide x.
    """
    _check(x, block_size)
    backend = resolve_impl(impl, x)
    ext = _cpp(x, backend, x.dtype)
    if ext is None:
        return nf4_quantize_reference(x, block_size)
    packed, absmax = ext.nf4_quantize(x.detach().contiguous().view(-1), block_size)
    return packed, absmax


def nf4_dequantize(
    packed: Tensor,
    absmax: Tensor,
    shape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
    impl: str = "auto",
) -> Tensor:
    """The values `nf4_quantize` coded, in `dtype` and `shape`.

    Raises:
        ValueError: packed/absmax are not uint8/fp32 or do not fit `shape` and `block_size`.
    """
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(f"nf4_dequantize: packed uint8 and absmax fp32, got {packed.dtype} "
                         f"and {absmax.dtype}")  # fmt: skip
    if packed.numel() * 2 != numel or absmax.numel() * block_size != numel:
        raise ValueError(
            f"nf4_dequantize: {packed.numel()} bytes and {absmax.numel()} blocks of "
            f"{block_size} do not hold shape {tuple(shape)}"
        )
    backend = resolve_impl(impl, packed)
    ext = _cpp(packed, backend, dtype)
    if ext is None:
        return nf4_dequantize_reference(packed, absmax, shape, dtype, block_size)
    return ext.nf4_dequantize(packed.contiguous(), absmax.contiguous(), block_size, dtype).view(
        shape
    )
