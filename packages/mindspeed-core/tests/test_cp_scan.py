"""`chunk_scan`: a recurrence over zig-zag chunks at cp=2 and cp=4 equals it over the whole
sequence on one process (a decayed running sum with a parameter: outputs, input, parameter
and initial-state-free gradients)."""

import pytest
import torch

from mindspeed_core.parallel import ParallelDims, chunk_scan, shard_sequence
from mindspeed_core.testing import run_distributed


def _decayed_sum(inputs, params, state):
    """s_t = decay * s_{t-1} + x_t, out_t = s_t; state (batch, channels)."""
    (x,), (decay,), (s,) = inputs, params, state
    outs = []
    for t in range(x.shape[1]):
        s = decay * s + x[:, t]
        outs.append(s)
    return [torch.stack(outs, dim=1)], [s]


def _case(world):
    dims = ParallelDims(cp=world).build()
    rank, group = dims.rank("cp"), dims.mesh("cp").get_group()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8 * world, 3, generator=gen)
    weight = torch.randn(2, 8 * world, 3, generator=gen)
    decay = torch.full((3,), 0.9)
    # one process: the whole sequence
    x_ref, d_ref = x.clone().requires_grad_(), decay.clone().requires_grad_()
    (ref,), _ = _decayed_sum([x_ref], [d_ref], [torch.zeros(2, 3)])
    (ref * weight).sum().backward()
    # cp ranks: this rank's zig-zag chunks
    x_local = shard_sequence(x, rank, world).requires_grad_()
    d_local = decay.clone().requires_grad_()
    (out,) = chunk_scan(_decayed_sum, [x_local], [d_local], [torch.zeros(2, 3)], group)
    (out * shard_sequence(weight, rank, world)).sum().backward()
    torch.testing.assert_close(out, shard_sequence(ref.detach(), rank, world))
    torch.testing.assert_close(x_local.grad, shard_sequence(x_ref.grad, rank, world))
    total = d_local.grad.clone()
    torch.distributed.all_reduce(total, group=group)  # each rank's chunks' share
    torch.testing.assert_close(total, d_ref.grad)
    return float(out.sum())


@pytest.mark.distributed
def test_chunk_scan_equals_the_whole_sequence_on_two_ranks():
    assert len(run_distributed(_case, 2, 2, timeout=120)) == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_chunk_scan_equals_the_whole_sequence_on_four_ranks():
    assert len(run_distributed(_case, 4, 4, timeout=300)) == 4
