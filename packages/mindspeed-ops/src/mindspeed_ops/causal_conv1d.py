"""Short causal depthwise convolution over the sequence, with the cache decoding needs.

Qwen3-Next's linear-attention layers (and Mamba's) mix q, k and v over the last few tokens with
one small filter per channel before the gated delta rule. While decoding, the last
kernel - 1 inputs are the cache that the next call continues from. torch's conv1d is the
kernel on every device, so this helper has no `impl=` choice. Not built: packed documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops.validate import check_float, check_same_device

ACTIVATIONS = (None, "silu")


def _validate(x, weight, bias, activation, cache):
    check_float("x", x)
    check_float("weight", weight)
    check_same_device("weight", weight, x)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, seq, channels), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be (channels={x.shape[-1]}, kernel), got shape "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if bias is not None:
        check_float("bias", bias)
        check_same_device("bias", bias, x)
        if bias.shape != (x.shape[-1],):
            raise ValueError(f"bias must be ({x.shape[-1]},), got shape {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if cache is not None:
        check_float("cache", cache)
        check_same_device("cache", cache, x)
        want = (x.shape[0], weight.shape[1] - 1, x.shape[-1])
        if tuple(cache.shape) != want:
            raise ValueError(f"cache must be (batch, kernel - 1, channels) = {want}, got "
                             f"{tuple(cache.shape)}")  # fmt: skip


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = "silu",
    cache: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """y_t = act(bias + sum_j weight[:, j] * x_{t - kernel + 1 + j}), per channel -> (y, cache).

    Args:
        x: (batch, seq, channels).
        weight: (channels, kernel), one filter per channel (nn.Conv1d's weight without its
            middle dim of 1).
        bias: (channels,) or None.
        activation: "silu" or None.
        cache: (batch, kernel - 1, channels), the inputs before x; None: zeros (a new sequence).

    Returns y (batch, seq, channels) in x's dtype and the new cache: the last kernel - 1 inputs.
    """
    _validate(x, weight, bias, activation, cache)
    history = weight.shape[1] - 1
    if cache is None:
        cache = x.new_zeros(x.shape[0], history, x.shape[-1])
    window = torch.cat([cache.to(x.dtype), x], dim=1)  # (batch, history + seq, channels)
    y = F.conv1d(window.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias,
                 groups=x.shape[-1]).transpose(1, 2)  # fmt: skip
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), window[:, window.shape[1] - history :]
