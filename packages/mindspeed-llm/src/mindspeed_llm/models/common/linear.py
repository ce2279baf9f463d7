"""`Linear`: the decoder's linear layer, an `nn.Linear` whose forward is `mindspeed_ops.linear`.

Same parameters, names, initialisation and `isinstance(m, nn.Linear)` as `nn.Linear`, so the
tensor-parallel plans, FSDP, LoRA and the checkpoint names see no difference. Training and
DTensor weights run `F.linear`; the few-row products of decoding on CPU run mindspeed-ops'
C++ kernel (see `mindspeed_ops.linear`).
"""

from __future__ import annotations

from torch import Tensor, nn

import mindspeed_ops as ops


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)
