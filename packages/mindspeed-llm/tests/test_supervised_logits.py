"""Logits only where a loss reads them (`Objective.supervised_logits_only`): SFT's
next-token loss (token and sample normalisation) and GRPO's clipped surrogate give the
same loss, metrics and gradients as projecting every position, while the output layer
sees only the supervised rows."""

from __future__ import annotations

import copy

import pytest
import torch

from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep


def _batch(seed: int = 0):
    """Two packed rows of prompt + reply documents: labels only on the replies."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (2, 24), generator=gen)
    labels = torch.full_like(ids, -100)
    bounds = [0, 10, 24, 31, 48]
    for hi, reply in ((10, 4), (24, 6), (31, 2), (48, 5)):  # document end, reply length
        flat = labels.view(-1)
        flat[hi - reply - 1 : hi - 1] = ids.view(-1)[hi - reply : hi]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:], strict=False)]).view(2, 24)
    return {"input_ids": ids, "labels": labels, "position_ids": positions,
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}  # fmt: skip


def _run(objective, model):
    dims = ParallelConfig().dims(1).build("cpu")
    parts = build_train_parts(model, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    rows = []
    hook = model.model.output.register_forward_hook(lambda m, a, out: rows.append(a[0].numel() // a[0].shape[-1]))
    result = TrainStep(parts, objective, dims, clip_grad=0.0)([_batch(0), _batch(1)])
    hook.remove()
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return result, grads, rows


@pytest.mark.parametrize("normalization", ["token", "sample"])
def test_sft_loss_and_grads_equal_projecting_every_position(normalization):
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    dims = ParallelConfig().dims(1).build("cpu")
    torch.manual_seed(0)
    model = build_model(config, dims, torch.device("cpu"), parallel=ParallelConfig(), seq_len=32)
    twin = copy.deepcopy(model)
    full, full_grads, full_rows = _run(NextToken(normalization), model)
    cut, cut_grads, cut_rows = _run(NextToken(normalization, supervised_logits_only=True), twin)
    assert full_rows == [48, 48] and cut_rows == [17, 17]  # 4 + 6 + 2 + 5 reply tokens
    assert cut.loss == pytest.approx(full.loss, rel=1e-6)
    assert cut.num_units == full.num_units
    for name, grad in full_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_grpo_surrogate_equals_projecting_every_position():
    pytest.importorskip("mindspeed_align")
    from mindspeed_align.rl.objective import GRPOObjective

    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    dims = ParallelConfig().dims(1).build("cpu")
    torch.manual_seed(0)
    model = build_model(config, dims, torch.device("cpu"), parallel=ParallelConfig(), seq_len=32)
    twin = copy.deepcopy(model)

    class EveryPosition(GRPOObjective):
        supervised_logits_only = False

    def batch(seed):
        b = _batch(seed)
        gen = torch.Generator().manual_seed(seed + 7)
        mask = (b["labels"] != -100).float()
        for key in ("weights", "metric_weights", "unit"):
            b[key] = mask.clone()
        b["advantages"] = torch.randn(mask.shape, generator=gen) * mask
        b["old_logps"] = -torch.rand(mask.shape, generator=gen) * 5 * mask
        return b

    results = []
    for objective, m in ((EveryPosition(eps_high=0.28), model), (GRPOObjective(eps_high=0.28), twin)):
        parts = build_train_parts(m, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
        result = TrainStep(parts, objective, dims, clip_grad=0.0)([batch(0), batch(1)])
        grads = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.grad is not None}
        results.append((result, grads))
    (full, full_grads), (cut, cut_grads) = results
    assert cut.loss == pytest.approx(full.loss, rel=1e-6)
    for key, value in full.metrics.items():
        assert cut.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert full.metrics["clip_fraction"] > 0  # the old log-probs are far: the clip is live
    for name, grad in full_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
