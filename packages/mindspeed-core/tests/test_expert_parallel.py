"""Expert parallel on a toy experts module (core alone, no model code): with ep=2 each rank's
outputs and the experts' gradients equal one process's (fp32, 2 gloo ranks, uneven token
counts, an expert that gets no tokens) with either dispatcher (all-to-all, all-gather), the
all-to-all is differentiable, and a number of experts that ep does not divide, or an unknown
dispatcher, is refused."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import ParallelDims, all_to_all, apply_ep
from mindspeed_core.testing import run_distributed

E, DIM = 4, 8


class ToyExperts(nn.Module):
    """Rows sorted by expert; expert e multiplies its rows by weight[e]."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(E, DIM, DIM, generator=torch.Generator().manual_seed(0))
        )

    def forward(self, x, num_tokens_per_expert):
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        pieces = torch.split(x, num_tokens_per_expert.tolist())
        return torch.cat([p @ w[i] for i, p in enumerate(pieces)])


def _tokens(rank):
    """Rank r's rows sorted by expert, and its counts (expert 3 gets none from rank 0)."""
    counts = torch.tensor([[3, 1, 2, 0], [0, 4, 1, 2]][rank])
    x = torch.randn(int(counts.sum()), DIM, generator=torch.Generator().manual_seed(10 + rank))
    return x, counts


def _ep_matches_one_process():
    rank = dist.get_rank()
    reference = ToyExperts()
    x, counts = _tokens(rank)
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref, counts)
    expected.square().sum().backward()
    # The one-process gradient of the weights sums both ranks' rows.
    other_grad = reference.weight.grad.clone()
    dist.all_reduce(other_grad)

    mesh = ParallelDims(dp_shard=2, ep=2).build().mesh("ep")
    for dispatcher in ("alltoall", "allgather"):
        experts = ToyExperts()
        apply_ep([experts], mesh, dispatcher=dispatcher)
        assert experts.weight.placements == (Shard(0),)
        assert experts.weight.to_local().shape[0] == 2
        x_ep = x.clone().requires_grad_()
        out = experts(x_ep, counts)
        out.square().sum().backward()
        torch.testing.assert_close(out, expected, msg=lambda m, d=dispatcher: f"{d}: {m}")
        torch.testing.assert_close(x_ep.grad, x_ref.grad)
        torch.testing.assert_close(experts.weight.grad.full_tensor(), other_grad)
    with pytest.raises(ParallelError, match=r"ep_dispatcher='ring'; choose one of"):
        apply_ep([ToyExperts()], mesh, dispatcher="ring")

    odd = ToyExperts()
    odd.weight = nn.Parameter(torch.randn(3, DIM, DIM))
    with pytest.raises(ParallelError, match=r"ep=2 must divide the number of experts \(3"):
        apply_ep([odd], ParallelDims(dp_shard=2, ep=2).build().mesh("ep"))

    # all_to_all alone: uneven splits there and back, gradient returns to the sender.
    sent = torch.arange(5.0 + rank).requires_grad_()
    splits = [[2, 3], [4, 2]][rank]
    back = [[2, 4], [3, 2]][rank]
    got = all_to_all(sent, back, splits, dist.group.WORLD)
    (got * (rank + 1)).sum().backward()
    return got.tolist(), sent.grad.tolist()


def test_ep2_matches_one_process():
    (got0, grad0), (got1, grad1) = run_distributed(_ep_matches_one_process, 2, timeout=300)
    assert got0 == [0.0, 1.0, 0.0, 1.0, 2.0, 3.0] and got1 == [2.0, 3.0, 4.0, 4.0, 5.0]
    assert grad0 == [1.0, 1.0, 2.0, 2.0, 2.0] and grad1 == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]


def test_ep_one_is_a_no_op():
    experts = ToyExperts()
    apply_ep([experts], None)
    assert not isinstance(experts.weight, DTensor)
