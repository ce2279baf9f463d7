"""`Linear`: the decoder's linear layer, an `nn.Linear` whose forward is `mindspeed_ops.linear`.

Same parameters, names, initialisation and `isinstance(m, nn.Linear)` as `nn.Linear`, so the
tensor-parallel plans, FSDP, LoRA and the checkpoint names see no difference. Training and
DTensor weights run `F.linear`; the few-row products of decoding on CPU run mindspeed-ops'
C++ kernel (see `mindspeed_ops.linear`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import mindspeed_ops as ops


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


def project_together(x: Tensor, linears: Sequence[nn.Linear]) -> tuple[Tensor, ...]:
    """`linear(x)` for each of `linears`, which all read `x` (attention's wq, wk, wv): one
    matmul in training (`joint_projection`), one layer at a time elsewhere."""
    out = joint_projection(x, linears)
    if out is None:
        return tuple(linear(x) for linear in linears)
    return out.split([linear.out_features for linear in linears], dim=-1)


def joint_projection(x: Tensor, linears: Sequence[nn.Linear]) -> Tensor | None:
    """The outputs of `linears`, which all read `x`, side by side on the last dim, from one
    matmul against their weights concatenated; None where that does not apply or pay.

    In training that is one kernel, one cast of x under autocast and one gradient of x
    instead of one of each per layer (attention's wq, wk, wv and the feed-forward's w1, w3:
    about thirty fewer ops per block on the eager path, forward and backward). The parameters
    stay separate (names, checkpoints, tensor-parallel plans). Only under autocast, where it
    holds no more memory: the layers one by one keep a low-precision copy of each weight for
    the backward, this keeps one of them side by side (without autocast the concatenation would
    be a copy of the weights kept until the backward, and under FSDP it would outlive the
    gathered weights it copies). It does not apply to an adapter or other module in place of a
    plain `Linear`, or to sharded (DTensor) weights, and does not pay without a gradient
    (decoding would copy every weight per token). Layers with forward hooks (LoRA's adapters,
    QLoRA's dequantisation) run one by one, hooks and all."""
    if not torch.is_grad_enabled() or not torch.is_autocast_enabled(x.device.type):
        return None
    if isinstance(x, DTensor):
        return None
    if _global_hooks():
        return None
    first = linears[0]
    for linear in linears:
        if type(linear) is not Linear or linear._forward_hooks or linear._forward_pre_hooks:
            return None  # LoRA's and QLoRA's layers: their hooks run with the layer
        if isinstance(linear.weight, DTensor):
            return None
        if linear.weight.dtype != first.weight.dtype or (linear.bias is None) != (first.bias is None):
            return None
    weight = torch.cat([linear.weight for linear in linears])
    bias = None if first.bias is None else torch.cat([linear.bias for linear in linears])
    return F.linear(x, weight, bias)


def _global_hooks() -> bool:
    """Whether module hooks are registered for every module (`nn.modules.module.
    register_module_forward_hook`): they must see each layer's call."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
