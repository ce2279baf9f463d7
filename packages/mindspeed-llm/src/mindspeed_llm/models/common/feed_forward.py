"""The SwiGLU feed-forward: w2(silu(w1 x) * w3 x); GeGLU (gelu_tanh, Gemma) on request."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.linear import Linear, joint_projection
from mindspeed_ops import swiglu


class FeedForward(nn.Module):
    """w1 (gate) and w3 (up) project to `intermediate_size`, w2 (down) projects back.

    torchtitan's names, so `tp_plan.llama_tp_plan` shards w1/w3 by column and w2 by row.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, impl: str = "auto", act: str = "silu"
    ):
        super().__init__()
        self.impl = impl
        self.act = act  # "silu" (the fused swiglu op) or "gelu_tanh" (plain PyTorch)
        self.w1 = Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = Linear(hidden_size, intermediate_size, bias=False)

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        init.normal(self.w1.weight, std)
        init.normal(self.w3.weight, std)
        init.normal(self.w2.weight, out_std)

    def forward(self, x: Tensor) -> Tensor:
        if self.act == "gelu_tanh":
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        gate_up = joint_projection(x, (self.w1, self.w3))  # [w1 x; w3 x], one matmul
        if gate_up is not None:
            return self.w2(swiglu(gate_up, impl=self.impl))
        return self.w2(swiglu(self.w1(x), self.w3(x), impl=self.impl))
