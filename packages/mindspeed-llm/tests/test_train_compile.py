"""`train.compile`: torch.compile per block gives eager training's losses and parameters.

Three optimizer steps on packed documents (cu_seqlens, the custom ops of `ops_impl=auto`),
fp32 on CPU, compiled vs eager in the same layout, 1e-5 relative: one process (not slow),
tp=2 with sequence parallel (the embedding's async collective feeds the first compiled
block: see `apply_compile`), and tp=2, dp_shard=2 with full recompute, pp=2 with
selective recompute and cp=2 ring / Ulysses (slow).
Every compiled block runs as one graph: no graph break is counted, and Dynamo's
`explain` of a block's forward finds one graph, no break; under context parallel the
only breaks are around its attention, which runs eagerly.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.parallel.compile import is_compiled
from mindspeed_core.testing import run_distributed
from mindspeed_llm.data.collate import lm_batch, split_batch
from mindspeed_llm.models import build_model_config
from mindspeed_llm.models.common.rope import rope_tables
from mindspeed_llm.models.common.transformer import Block
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep

ROWS, SEQ, EOD, STEPS = 4, 16, 7, 3


def _batch(seed: int) -> dict:
    samples = torch.randint(8, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    samples[:, 6] = EOD  # two documents a row
    return lm_batch(samples, EOD)


def _train(parallel: ParallelConfig, *, compile: bool, ac="none", world_size=None, family="llama"):
    """Losses of STEPS steps and the parameters after them."""
    import torch.distributed as dist

    dims = parallel.dims(world_size).build("cpu")
    config = build_model_config(family, flavor="debug", ops_impl="auto")
    model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ,
                        ac=ac, compile=compile)  # fmt: skip
    assert all(is_compiled(b) == compile for p in model.parts for b in p.layers.values())
    parts = build_train_parts(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=STEPS)
    step = TrainStep(parts, NextToken(), dims, clip_grad=1.0,
                     n_microbatches=2 if dims.pp > 1 else None)  # fmt: skip
    losses = []
    for _ in range(STEPS):
        batches = split_batch(_batch(0), 2)  # the same: the loss must fall
        if dims.dp_shard > 1:  # each data rank its own rows
            batches = [batches[dist.get_rank()]]
        losses.append(step(batches).loss)
    params = {n: _full(p).detach().clone() for part in parts.model.parts
              for n, p in part.named_parameters()}  # fmt: skip
    return losses, params


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(parallel: ParallelConfig, ac="none", world_size=None, family="llama"):
    counters.clear()
    eager = _train(parallel, compile=False, ac=ac, world_size=world_size, family=family)
    assert not counters["stats"]  # eager never entered Dynamo
    compiled = _train(parallel, compile=True, ac=ac, world_size=world_size, family=family)
    return eager, compiled, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def _assert_same(results, allowed_breaks=0, atol=1e-5):
    for (eager_losses, eager_params), (losses, params), breaks, graphs in results:
        assert sum(breaks.values()) <= allowed_breaks and graphs >= 1, breaks
        assert losses == pytest.approx(eager_losses, rel=1e-5)
        assert losses[-1] < losses[0] - 0.05  # it trained
        assert params.keys() == eager_params.keys()  # no `_orig_mod` in any name
        for name, value in params.items():
            torch.testing.assert_close(value, eager_params[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.slow  # CI: test_train_compile_families.py (losses and gradients, one process)
def test_compiled_training_is_eager_training_one_process():
    _assert_same([_compare(ParallelConfig(), world_size=1)])


def test_a_block_compiles_to_one_graph_without_breaks():
    config = build_model_config("llama", flavor="debug", ops_impl="auto")
    block, rope = Block(0, config), rope_tables(config)
    x = torch.randn(2, SEQ, config.hidden_size)
    positions = torch.arange(SEQ).repeat(2, 1)
    cu_seqlens = torch.tensor([0, 6, SEQ, SEQ + 6, 2 * SEQ], dtype=torch.int32)
    explained = torch._dynamo.explain(block.forward)(x, rope, positions, cu_seqlens)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert any("mindspeed" in op for op in ops)  # the custom ops are in the graph


@pytest.mark.distributed
def test_compiled_training_is_eager_training_tp2_sequence_parallel():
    parallel = ParallelConfig(tp=2, sequence_parallel=True)
    _assert_same(run_distributed(_compare, 2, parallel, timeout=600))


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_training_is_eager_training_tp2():
    _assert_same(run_distributed(_compare, 2, ParallelConfig(tp=2), timeout=600))


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_training_is_eager_training_dp_shard2_full_recompute():
    _assert_same(run_distributed(_compare, 2, ParallelConfig(dp_shard=2), "full", timeout=600))


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_training_is_eager_training_pp2_selective_recompute():
    _assert_same(run_distributed(_compare, 2, ParallelConfig(pp=2), "selective", timeout=600))


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_training_is_eager_training_cp2_ring_and_ulysses():
    """Context parallel's attention runs eagerly between a block's two graphs (its ring loop
    reads document boundaries as ints): one break per block and pass, nothing else."""
    for mode in ("ring", "ulysses"):
        results = run_distributed(_compare, 2, ParallelConfig(cp=2, cp_mode=mode), timeout=600)
        for *_, breaks, _ in results:
            assert all("compiler.disable()" in b and "ContextParallel" in b for b in breaks), breaks
        _assert_same(results, allowed_breaks=10**6)


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_training_is_eager_training_moe_ep2():
    """Mixtral debug, experts split over 2 ranks (ep=2 over dp_shard=2)."""
    parallel = ParallelConfig(dp_shard=2, ep=2)
    # Losses equal to 1e-5; experts' weights to 5e-5: a rarely routed expert row has a
    # gradient near zero, where AdamW's first steps (m / sqrt(v), lr 1e-2) turn inductor's
    # last-bit differences into ~2e-5 (measured 1.9e-5 since packed attention moved to the
    # C++ flash kernel, whose rounding differs from the composed path's).
    _assert_same(run_distributed(_compare, 2, parallel, family="mixtral", timeout=600), atol=5e-5)
