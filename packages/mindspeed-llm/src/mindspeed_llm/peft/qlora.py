"""QLoRA: the frozen base's linear weights stored in NF4 (mindspeed_ops.nf4_quantize, block
64, fp32 absmax), dequantised for each forward in the input's dtype.

`quantize_base(model)` runs after `apply_lora` (in the same `after_tp` hook): every linear
layer of the decoder blocks (q/k/v/o, gate/up/down) loses its weight parameter and keeps
two buffers, `weight_nf4` (uint8, two codes a byte) and `weight_absmax` (fp32), not saved in
checkpoints (the run rebuilds the base from its source). A forward pre-hook sets
`linear.weight` to the dequantised tensor (a DTensor with the old placements under tensor
parallel: each rank quantises its own shard), which the forward hook drops again, so only
autograd keeps it, as long as the backward needs it. Under FSDP the quantised base is not
sharded (buffers stay whole on every data-parallel rank); only the adapters are.

A model built on the meta device has no values to quantise yet: there each weight is marked
(`materialized_hook`, run by `mindspeed_core.parallel.run_materialized_hooks` once the
weights are drawn or read) and left whole by FSDP (`pending_weights`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError
from mindspeed_llm.peft.targets import HF_NAMES
from mindspeed_ops import nf4_dequantize, nf4_quantize

BLOCK_SIZE = 64
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
DEVICE_TYPES = ("cpu", "cuda", "npu")

__all__ = ["BLOCK_SIZE", "base_weight_bytes", "check_qlora", "pending_weights", "quantize_base"]


def check_qlora(precision: str, device_type: str) -> None:
    """Refuse what NF4 cannot serve, in one line.

    Raises:
        ConfigError: fp16 compute, or a device type without the NF4 op.
    """
    if precision == "fp16":
        raise ConfigError(
            "lora.quantize=nf4 computes in bf16 or fp32; train.precision=fp16 cannot serve it"
        )
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"lora.quantize=nf4 has no NF4 kernel on device {device_type!r}")


def quantize_base(model: nn.Module, *, block_size: int = BLOCK_SIZE) -> list[str]:
    """Store every decoder linear weight of (frozen) `model` in NF4; returns their names.

    Raises:
        ConfigError: a weight (or its tensor-parallel shard) whose size `block_size` does
            not divide, or a weight that still needs gradients.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in HF_NAMES:
            local = _check(name, module, block_size)
            if local.is_meta:  # quantised once materialised and filled
                module.materialized_hook = functools.partial(_quantize, name, module, block_size)
            else:
                _quantize(name, module, block_size)
            names.append(name)
    return names


def pending_weights(model: nn.Module) -> set[nn.Parameter]:
    """The weights `quantize_base` will quantise once the model is materialised: FSDP must
    leave them whole (they become buffers of this rank's tensor-parallel shard)."""
    return {
        m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and getattr(m, "materialized_hook", None) is not None
    }


def _check(name: str, linear: nn.Linear, block_size: int) -> torch.Tensor:
    weight = linear.weight
    if weight.requires_grad:
        raise ConfigError(f"lora.quantize=nf4: {name}.weight is trainable; only a frozen base")
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if local.numel() % block_size:
        raise ConfigError(
            f"lora.quantize=nf4: {name}.weight shard {tuple(local.shape)} is not a multiple "
            f"of the block size {block_size}"
        )
    return local


def _quantize(name: str, linear: nn.Linear, block_size: int) -> None:
    weight = linear.weight
    local = _check(name, linear, block_size)
    packed, absmax = nf4_quantize(local.detach().contiguous(), block_size=block_size)
    layout = None
    if isinstance(weight, DTensor):
        layout = (weight.device_mesh, weight.placements, weight.shape, weight.stride())
    del linear.weight
    linear.register_buffer("weight_nf4", packed, persistent=False)
    linear.register_buffer("weight_absmax", absmax, persistent=False)
    linear.nf4_shape, linear.nf4_block = tuple(local.shape), block_size
    linear.register_forward_pre_hook(functools.partial(_dequantize, layout=layout))
    linear.register_forward_hook(_drop_weight)


def _dequantize(linear: nn.Linear, args, *, layout) -> None:
    x = args[0]
    dtype = x.dtype if x.dtype in COMPUTE_DTYPES else torch.float32
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    weight = nf4_dequantize(linear.weight_nf4, linear.weight_absmax, linear.nf4_shape,
                            dtype=dtype, block_size=linear.nf4_block)  # fmt: skip
    if layout is not None:
        mesh, placements, shape, stride = layout
        weight = DTensor.from_local(weight, mesh, placements, shape=shape, stride=stride)
    linear.weight = weight  # a plain attribute for this forward, see _drop_weight


def _drop_weight(linear: nn.Linear, args, output) -> None:
    del linear.weight


def base_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the NF4 base weights hold on this rank, bytes they would take in bf16)."""
    stored = bf16 = 0
    for module in model.modules():
        if hasattr(module, "weight_nf4"):
            stored += module.weight_nf4.nbytes + module.weight_absmax.nbytes
            bf16 += 2 * module.weight_nf4.numel() * 2
    return stored, bf16
