"""The step's loss is the mean over the supervised units of the whole step.

Labels are masked on very unequal spans (1 to 15 supervised tokens a row, in packed
documents), so a per-micro-batch mean would weigh tokens differently in every layout.
- accumulation: 4 micro-batches of 2 rows = 1 of 8 (loss and gradients, fp32, 1e-6), and
  both equal the hand-written global token mean (and differ from the old per-micro-batch
  mean, so the test can fail);
- layouts: dp_shard=2, cp=2 (ring, Ulysses) and pp=2 give one process's loss and
  gradients on the same batch, dp_shard=2 and cp=2 also with the loss through the fused
  linear + cross-entropy op (FSDP's gathered output weight read inside the forward);
- `loss_normalization: sample`: the mean per document, then over documents.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import run_distributed
from mindspeed_llm.data.collate import concat_batches, lm_batch, split_batch
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep

ROWS, SEQ, EOD = 8, 16, 7
SPANS = [(0, 1), (2, 16), (5, 6), (0, 16), (9, 12), (15, 16), (1, 9), (3, 4)]  # supervised


def _batch() -> dict:
    gen = torch.Generator().manual_seed(3)
    samples = torch.randint(8, 512, (ROWS, SEQ + 1), generator=gen)
    samples[:, 6] = EOD  # two documents a row
    batch = lm_batch(samples, EOD)
    keep = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    for row, (start, end) in enumerate(SPANS):
        keep[row, start:end] = True
    batch["labels"] = batch["labels"].masked_fill(~keep, -100)
    return batch


def _config():
    return build_model_config("llama", flavor="debug", ops_impl="reference")


def _step(parallel: ParallelConfig, normalization="token", n_microbatches=None, world_size=None,
          fused="off"):  # fmt: skip
    dims = parallel.dims(world_size).build("cpu")
    model = build_model(_config(), dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ)
    parts = build_train_parts(model, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    return TrainStep(parts, NextToken(normalization), dims, clip_grad=0.0,
                     n_microbatches=n_microbatches, fused_linear_cross_entropy=fused)  # fmt: skip


def _grads(step: TrainStep) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for part in step.model.parts
        for name, p in part.named_parameters()
    }


def _run(parallel, micro_batches, normalization="token", n_microbatches=None, world_size=None,
         fused="off"):  # fmt: skip
    step = _step(parallel, normalization, n_microbatches, world_size, fused)
    result = step(micro_batches)
    return result, _grads(step)


def test_accumulation_gives_the_global_token_mean():
    batch = _batch()
    one, grads_one = _run(ParallelConfig(), [batch])
    four, grads_four = _run(ParallelConfig(), split_batch(batch, 4))
    assert one.num_units == four.num_units == sum(e - s for s, e in SPANS)
    assert four.loss == pytest.approx(one.loss, abs=1e-6)
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_four[name], grad, atol=1e-6, rtol=0, msg=name)
    # The oracle: one forward of the untouched model, summed nll / supervised tokens.
    model = _step(ParallelConfig()).model.model
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    assert one.loss == pytest.approx((nll.sum() / one.num_units).item(), abs=1e-6)
    nll, supervised = nll.view(4, -1), batch["labels"].view(4, -1) != -100
    old = torch.stack([nll[i][supervised[i]].mean() for i in range(4)]).mean()
    assert abs(old.item() - one.loss) > 1e-3  # the old per-micro-batch weighting differs


def test_sample_normalization_is_the_mean_of_document_means():
    batch = _batch()
    result, _ = _run(ParallelConfig(), split_batch(batch, 2), normalization="sample")
    model = _step(ParallelConfig()).model.model
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    supervised = batch["labels"].flatten() != -100
    cu = batch["cu_seqlens"].tolist()
    means = [
        nll[a:b][supervised[a:b]].mean() for a, b in itertools.pairwise(cu) if supervised[a:b].any()
    ]
    assert result.num_units == len(means)
    assert result.loss == pytest.approx(torch.stack(means).mean().item(), abs=1e-6)


LAYOUTS = {
    "dp_shard2": ParallelConfig(dp_shard=2),
    "cp2_ring": ParallelConfig(cp=2, cp_mode="ring"),
    "cp2_ulysses": ParallelConfig(cp=2, cp_mode="ulysses"),
    "pp2": ParallelConfig(pp=2),
}


def _layouts(names, normalization):
    import torch.distributed as dist

    batch = _batch()
    reference = _run(ParallelConfig(), split_batch(batch, 2), normalization, world_size=1)
    out = {}
    for name in names:  # "<layout>+fused": the loss through the fused linear + cross entropy
        parallel, fused = LAYOUTS[name.removesuffix("+fused")], "on" if "+" in name else "off"
        if parallel.dp_shard == 2:  # each data rank its half of the rows, in 2 micro-batches
            mine = split_batch(batch, 2)[dist.get_rank()]
            result, grads = _run(parallel, split_batch(mine, 2), normalization, fused=fused)
        else:  # every rank reads the whole batch
            n = 4 if parallel.pp > 1 else None
            result, grads = _run(parallel, split_batch(batch, 2), normalization, n, fused=fused)
        out[name] = (result.loss, result.num_units, grads)
    return reference[0].loss, reference[0].num_units, reference[1], out


def _assert_layouts(ranks):
    for want_loss, want_units, want_grads, results in ranks:
        for name, (loss, units, grads) in results.items():
            assert units == want_units, name
            assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6), name
            assert grads and set(grads) <= set(want_grads), name
            for param, grad in grads.items():
                torch.testing.assert_close(grad, want_grads[param], rtol=1e-5, atol=1e-6,
                                           msg=f"{name} {param}")  # fmt: skip


@pytest.mark.distributed
def test_dp_shard_cp_ring_and_pp_give_one_process_token_mean():
    names = ["dp_shard2", "cp2_ring", "pp2", "dp_shard2+fused", "cp2_ring+fused"]
    _assert_layouts(run_distributed(_layouts, 2, names, "token", timeout=300))


@pytest.mark.distributed
@pytest.mark.slow
def test_ulysses_and_sample_normalization_give_one_process_means():
    _assert_layouts(run_distributed(_layouts, 2, ["cp2_ulysses"], "token", timeout=300))
    _assert_layouts(run_distributed(_layouts, 2, list(LAYOUTS), "sample", timeout=600))


def test_pipeline_microbatches_regroup_rows_exactly():
    """split_batch(concat_batches(...)) gives what collating each chunk's rows gives."""
    samples = torch.randint(8, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(4))
    samples[:, 6] = EOD
    samples[1, -1] = EOD  # a row ending on a document boundary
    parts = split_batch(lm_batch(samples, EOD), 4)
    again = split_batch(concat_batches(parts), 2)
    for i, got in enumerate(again):
        want = lm_batch(samples[4 * i : 4 * (i + 1)], EOD)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key
