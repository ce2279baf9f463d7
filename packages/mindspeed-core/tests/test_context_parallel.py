"""Context parallel attention equals full attention on one process (fp32, gloo ranks):
outputs and dq/dk/dv for ring, Ulysses and hybrid, causal rows and packed documents, GQA
(including fewer kv heads than Ulysses ranks) and sliding windows in every mode, with the
ring's backward from merged statistics and by recompute; attention sinks (gpt-oss) against
transformers' own gpt-oss attention, their gradient summed over the cp ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import (
    ContextParallel,
    ParallelDims,
    cp_degrees,
    gather_tokens,
    packed_shard_index,
    shard_sequence,
    unshard_packed,
    unshard_sequence,
)
from mindspeed_core.parallel.context_parallel import check_cp_heads, reference_attention
from mindspeed_core.testing import run_distributed

TOL = {"rtol": 1e-4, "atol": 1e-5}
CU = torch.tensor([0, 5, 16, 30, 32, 48], dtype=torch.int32)  # docs of 5, 11, 14, 2, 16


def _inputs(tokens, heads, kv_heads, dim=8):
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (
        torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads)
    )
    return q, k, v, w


def _reference(q, k, v, w, cu, window=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q, k, v, cu_seqlens=cu, window=window)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _hf_sinks_reference(q, k, v, w, cu, window, sinks):
    """transformers' gpt-oss eager attention (sinks), one document at a time."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    module = nn.Module()
    module.sinks, module.training = sinks, False
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        mask = torch.zeros(b - a, b - a).masked_fill(~allowed, torch.finfo(torch.float32).min)
        heads_first = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        out, _ = eager_attention_forward(module, *heads_first, mask, scaling=q.shape[-1] ** -0.5)
        outs.append(out[0])
    out = torch.cat(outs)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def _check_packed(context, rank, cp, heads, kv_heads, window=None, sinks=False):
    """Packed documents, each zig-zagged on its own; compare on this rank's tokens."""
    q, k, v, w = _inputs(int(CU[-1]), heads, kv_heads)
    extra = {}
    if sinks:
        extra["sinks"] = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2
        *want, want_sinks = _hf_sinks_reference(q, k, v, w, CU, window, extra["sinks"])
        extra["sinks"].requires_grad_()
    else:
        want = _reference(q, k, v, w, CU, window)
    index, local_cu = packed_shard_index(CU, rank, cp)
    local = [gather_tokens(t, index).requires_grad_() for t in (q, k, v)]
    out = context(*local, cu_seqlens=local_cu, window=window, **extra)
    (out * gather_tokens(w, index)).sum().backward()
    if sinks:  # each rank holds part of the rows (and under Ulysses, of the heads)
        grad = extra["sinks"].grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, want_sinks, **TOL)
    real = index >= 0
    torch.testing.assert_close(out[real], gather_tokens(want[0], index)[real], **TOL)
    for got, expected in zip(local, want[1:], strict=True):
        torch.testing.assert_close(got.grad, gather_tokens(expected, index), **TOL)
    group = context.ring_group or context.ulysses_group
    if context.ring_group is None or context.ulysses_group is None:  # one group spans cp
        torch.testing.assert_close(unshard_packed(out, index, int(CU[-1]), group), want[0], **TOL)


def _check_batched(context, rank, cp, heads, kv_heads, group):
    """(batch, seq) rows, each zig-zagged with shard_sequence."""
    batch, seq = 2, 16
    q, k, v, w = _inputs(batch * seq, heads, kv_heads)
    rows = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    want = _reference(q, k, v, w, rows)
    as_rows = [t.view(batch, seq, *t.shape[1:]) for t in (q, k, v, w, *want)]
    local = [shard_sequence(t, rank, cp).requires_grad_() for t in as_rows[:3]]
    out = context(*local)
    (out * shard_sequence(as_rows[3], rank, cp)).sum().backward()
    torch.testing.assert_close(out, shard_sequence(as_rows[4], rank, cp), **TOL)
    for got, expected in zip(local, as_rows[5:], strict=True):
        torch.testing.assert_close(got.grad, shard_sequence(expected, rank, cp), **TOL)
    torch.testing.assert_close(unshard_sequence(out.detach(), group), as_rows[4], **TOL)


def _modes(world):
    mesh = ParallelDims(cp=world).build().mesh("cp")
    rank, group = mesh.get_local_rank(), mesh.get_group()
    contexts = {"ring": ContextParallel.from_mesh(mesh, "ring")}
    contexts["ulysses"] = ContextParallel.from_mesh(mesh, "ulysses")
    if world == 4:
        contexts["hybrid"] = ContextParallel.from_mesh(mesh, "hybrid", ulysses_degree=2)
    checked = []
    for mode, context in contexts.items():
        for heads, kv_heads in ((4, 2), (8, 1)):
            _check_batched(context, rank, world, heads, kv_heads, group)
            _check_packed(context, rank, world, heads, kv_heads)
            checked.append((mode, heads, kv_heads))
    for mode, context in contexts.items():  # windows across chunk boundaries, every mode
        for window in (3, 6):
            _check_packed(context, rank, world, 4, 2, window=window)
            checked.append((mode, "window", window))
    # The ring without a backward kernel recomputes each block and differentiates the merge.
    recompute = ContextParallel(ring_group=group, attention_fn=reference_attention,
                                attention_bwd_fn=None)  # fmt: skip
    _check_packed(recompute, rank, world, 8, 1)
    _check_packed(recompute, rank, world, 4, 2, window=3)
    for mode, context in contexts.items():  # attention sinks join the merge once
        _check_packed(context, rank, world, 4, 2, window=3 if mode == "ring" else None, sinks=True)
    _check_packed(recompute, rank, world, 4, 2, sinks=True)
    return checked


@pytest.mark.distributed
def test_ring_and_ulysses_match_full_attention_on_two_ranks():
    for checked in run_distributed(_modes, 2, 2, timeout=300):
        assert len(checked) == 8


@pytest.mark.distributed
@pytest.mark.slow
def test_ring_ulysses_and_hybrid_match_full_attention_on_four_ranks():
    for checked in run_distributed(_modes, 4, 4, timeout=600):
        assert len(checked) == 12


def test_packed_shard_index_pads_each_document_and_zigzags_it():
    index, local_cu = packed_shard_index(torch.tensor([0, 5, 8]), cp_rank=0, cp=2)
    # doc 0 (5 tokens) padded to 8, chunks of 2: rank 0 takes chunks 0 and 3
    # doc 1 (3 tokens) padded to 4, chunks of 1: rank 0 takes chunks 0 and 3
    assert index.tolist() == [0, 1, -1, -1, 5, -1]
    assert local_cu.tolist() == [0, 4, 6]
    assert gather_tokens(torch.arange(8) * 10, index, -100).tolist() == [
        0,
        10,
        -100,
        -100,
        50,
        -100,
    ]
    seq = torch.arange(16).view(1, 16)
    assert shard_sequence(seq, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(seq, 1, 2, load_balance=False).tolist() == [list(range(8, 16))]


def test_bad_layouts_name_the_values():
    assert cp_degrees(4, "hybrid", 2) == (2, 2)
    assert cp_degrees(4, "ring") == (4, 1) and cp_degrees(4, "ulysses") == (1, 4)
    with pytest.raises(ParallelError, match="ulysses_degree dividing cp=4, got 3"):
        cp_degrees(4, "hybrid", 3)
    with pytest.raises(ParallelError, match="cp_mode='zigzag'"):
        cp_degrees(2, "zigzag")
    with pytest.raises(ParallelError, match="num_heads=6"):
        check_cp_heads(6, 2, 4)
    with pytest.raises(ParallelError, match="num_kv_heads=3"):
        check_cp_heads(6, 3, 2)
    check_cp_heads(8, 1, 4)  # one kv head: repeated on every rank
    with pytest.raises(ParallelError, match="sequence length 12 is not divisible by 8"):
        shard_sequence(torch.zeros(1, 12), 0, 4)
