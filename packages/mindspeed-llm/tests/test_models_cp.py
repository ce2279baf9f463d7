"""Context parallel dense models give one process's loss and gradients (fp32, gloo): ring
and Ulysses at cp=2 (both with a binding sliding window; the ring also with Gemma 2's soft
caps), hybrid 2 x 2 at cp=4,
dp_shard=2 x cp=2 and tp=2 x cp=2; rows sharded zig-zag with `shard_sequence` and packed
documents with `packed_shard_index`, RoPE at global positions.

Each rank's loss is its token sum / the data-parallel rank's token count x cp: FSDP over
dp_shard x cp averages gradients over the cp ranks too, and the sum over cp ranks of the
unscaled losses is that data-parallel rank's mean."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.parallel import (
    ParallelDims,
    gather_tokens,
    packed_shard_index,
    shard_sequence,
)
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_ops import position_ids_from_cu_seqlens

TOL = {"rtol": 1e-4, "atol": 1e-5}
BATCH, SEQ = 4, 16  # two micro-batches of 2 rows
# documents over each data-parallel rank's 2 rows of 16: 5, 11, 14, 2 tokens
CU = torch.tensor([0, 5, 16, 30, 32], dtype=torch.int32)


def _batch():
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, 512, (BATCH, SEQ), generator=gen) for _ in range(2))


def _model(family):
    torch.manual_seed(0)
    spec = get_model_spec(family)
    # windows binding at seq 16 (and crossing the zig-zag chunks of 4 tokens at cp=2)
    overrides = {"sliding_window": 6} if family in ("mistral", "gemma2") else {}
    return spec, spec.build(build_model_config(family, flavor="debug", **overrides))


def _reference(family, packed):
    """Mean loss over every data-parallel half of the batch, and its gradients."""
    _, model = _model(family)
    tokens, labels = _batch()
    losses = []
    for half in (slice(0, 2), slice(2, 4)):
        logits = model(tokens[half], cu_seqlens=CU if packed else None)
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels[half].flatten()))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _local_inputs(tokens, labels, cp_rank, cp, packed):
    if not packed:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        local = (shard_sequence(t, cp_rank, cp) for t in (tokens, labels, positions))
        return (*local, None)
    index, local_cu = packed_shard_index(CU, cp_rank, cp)
    positions = position_ids_from_cu_seqlens(CU)
    local = [
        gather_tokens(t.flatten(), index, pad)[None]
        for t, pad in ((tokens, 0), (labels, -100), (positions, 0))
    ]
    return (*local, local_cu)


def _run_cp(family, degrees, options, packed):
    spec, model = _model(family)
    dims = ParallelDims(**degrees).build()
    model = spec.parallelize(model, dims, **options)
    tokens, labels = _batch()
    halves = [slice(0, 2), slice(2, 4)][dims.rank("dp") :: dims.dp]  # this dp rank's rows
    loss = 0.0
    for rows in halves:
        local = _local_inputs(tokens[rows], labels[rows], dims.rank("cp"), dims.cp, packed)
        tokens_local, labels_local, positions, cu_seqlens = local
        logits = model(tokens_local, position_ids=positions, cu_seqlens=cu_seqlens)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels_local.flatten(), reduction="sum")
        loss = loss + loss_sum / labels[rows].numel() * dims.cp / len(halves)
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
        for n, p in model.named_parameters()
    }
    return reported / dist.get_world_size(), grads


def _layouts(cases):
    return {name: _run_cp(*case) for name, case in cases.items()}


CASES_2 = {
    "ring": ("llama", {"cp": 2}, {"cp_mode": "ring"}, False),
    "ring_packed_full_ac": ("llama", {"cp": 2}, {"cp_mode": "ring", "ac_mode": "full"}, True),
    "ulysses_packed_qwen3": ("qwen3", {"cp": 2}, {"cp_mode": "ulysses"}, True),
    "ulysses_mistral_window": ("mistral", {"cp": 2}, {"cp_mode": "ulysses"}, False),
    "ring_mistral_window_packed": ("mistral", {"cp": 2}, {"cp_mode": "ring"}, True),
    # Gemma 2: its own score scale, soft-capped scores, windows on alternate blocks
    "ring_gemma2_softcap": ("gemma2", {"cp": 2}, {"cp_mode": "ring"}, False),
}
CASES_4 = {
    "hybrid_2x2_packed": ("llama", {"cp": 4}, {"cp_mode": "hybrid", "ulysses_degree": 2}, True),
    "dp_shard2_cp2_ring_packed": ("llama", {"dp_shard": 2, "cp": 2}, {}, True),
    "dp_shard2_cp2_ulysses": ("qwen2", {"dp_shard": 2, "cp": 2}, {"cp_mode": "ulysses"}, False),
    "tp2_cp2_ring_packed": ("llama", {"tp": 2, "cp": 2}, {}, True),
}


def _check(ranks, cases):
    references = {}
    for results in ranks:
        for name, (loss, grads) in results.items():
            family, _, _, packed = cases[name]
            if (family, packed) not in references:
                references[family, packed] = _reference(family, packed)
            want_loss, want_grads = references[family, packed]
            torch.testing.assert_close(loss, want_loss, **TOL, msg=name)
            assert grads.keys() == want_grads.keys()
            for param, value in want_grads.items():
                torch.testing.assert_close(grads[param], value, **TOL, msg=f"{name} {param}")


@pytest.mark.distributed
def test_cp2_ring_and_ulysses_match_one_process():
    _check(run_distributed(_layouts, 2, CASES_2, timeout=300), CASES_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_cp4_hybrid_and_dp_shard_times_cp_match_one_process():
    _check(run_distributed(_layouts, 4, CASES_4, timeout=600), CASES_4)
