"""Weight-only quantization for decoding: int8 weights with one fp scale per output channel.

At batch 1 a decode step reads every weight once, so its time is the bytes of the weights
over the memory's read bandwidth: int8 weights are a quarter of fp32's bytes (half of
bf16's). `Int8Linear` keeps `weight` as int8 (out, in) and `scale` (out,) fp32 with
`weight * scale[:, None]` ~ the original; its matmul is `mindspeed_ops.linear`: on CPU, for
the few rows of a decode step, a C++ kernel that reads the int8 weights directly (7-40x
PyTorch's `torch._weight_int8pack_mm` here, see `benchmarks/ops.py`), otherwise the
dequantised GEMM. Activations stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import mindspeed_ops as ops
from mindspeed_core.errors import ConfigError

__all__ = ["Int8Linear", "quantize_int8", "quantize_weights"]


@torch.no_grad()
def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (int8 weight, scale) with weight ~ q * scale."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(weight.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A bias-free `nn.Linear` whose weight is int8 with a scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ConfigError("int8 weight-only decoding supports bias-free linear layers only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, scale=self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_weights(model: nn.Module, *, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every bias-free `nn.Linear` of `model` (but those named in `skip`) by an
    `Int8Linear`, in place; for inference (the int8 weights take no gradient).

    Raises:
        ConfigError: the model is tensor parallel (quantize a whole model).
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.bias is None and name not in skip
    ]
    if any(isinstance(module.weight, DTensor) for _, module in targets):
        raise ConfigError("int8 weight-only decoding needs a whole model, not tensor parallel")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return model
