"""Recompute really recomputes: count the forward ops that run again during backward."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import apply_ac
from mindspeed_core.testing import import_sibling

toy = import_sibling(__file__, "toy")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str):
    model = apply_ac(toy.make_model(), mode)
    tokens, labels = toy.make_batches(1)[0]
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    with _CountOps() as counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return counter.counts, grads, list(dict(model.named_parameters()))


def test_full_and_selective_recompute_what_they_should():
    none_ops, none_grads, names = _backward_ops("none")
    full_ops, full_grads, full_names = _backward_ops("full")
    sel_ops, sel_grads, sel_names = _backward_ops("selective")
    assert names == full_names == sel_names  # recompute leaves parameter names alone
    # Full recompute re-runs each block's matmuls up to the last one whose output backward
    # needs (6 of 7 linears: the down projection only feeds a residual add) x 2 layers.
    assert full_ops["mm"] == none_ops["mm"] + 12
    assert full_ops["rsqrt"] > none_ops["rsqrt"]
    # Selective keeps matmul and attention outputs and recomputes only the cheap ops.
    assert sel_ops["mm"] == none_ops["mm"]
    assert sel_ops["_scaled_dot_product_flash_attention_for_cpu"] == 0
    assert full_ops["_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert sel_ops["rsqrt"] > none_ops["rsqrt"] and sel_ops["silu"] > none_ops["silu"]
    for name, grad in none_grads.items():  # and the gradients do not change
        torch.testing.assert_close(full_grads[name], grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(sel_grads[name], grad, atol=1e-6, rtol=0)


def test_unknown_mode_and_missing_blocks_are_errors():
    with pytest.raises(ParallelError, match="mode 'some'"):
        apply_ac(toy.make_model(), "some")
    with pytest.raises(
        ParallelError, match="Linear has no ModuleList/ModuleDict attribute 'layers'"
    ):
        apply_ac(torch.nn.Linear(2, 2), "full")
