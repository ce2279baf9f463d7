"""Seeding per mesh axis, FLOPs accounting against a FLOP counter, MFU helpers."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mindspeed_core import device
from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import (
    ThroughputMeter,
    dense_params,
    flops_per_token,
    mfu,
    moe_active_params,
    set_seed,
)

toy = import_sibling(__file__, "toy")


def _draws_per_axis_choice():
    dims = ParallelDims(tp=2, dp_shard=2).build()
    out = {"coords": (dims.rank("dp"), dims.rank("tp"))}
    for name, axes in {
        "default": ("pp",),
        "tp": ("tp",),
        "dp": ("dp",),
        "both": ("dp", "tp"),
    }.items():
        set_seed(42, dims, vary_along=axes)
        out[name] = torch.rand(4)
    return out


@pytest.mark.distributed
def test_seeds_differ_exactly_along_the_chosen_axes():
    results = run_distributed(_draws_per_axis_choice, 4)
    by_coord = {r["coords"]: r for r in results}
    a, same_dp, same_tp = by_coord[(0, 0)], by_coord[(0, 1)], by_coord[(1, 0)]
    assert all(torch.equal(r["default"], a["default"]) for r in results)  # no pp: all equal
    assert torch.equal(a["tp"], same_tp["tp"]) and not torch.equal(a["tp"], same_dp["tp"])
    assert torch.equal(a["dp"], same_dp["dp"]) and not torch.equal(a["dp"], same_tp["dp"])
    assert len({tuple(r["both"].tolist()) for r in results}) == 4
    set_seed(42)  # one process, no layout
    assert torch.equal(torch.rand(4), a["default"])


def test_flops_per_token_matches_a_flop_counter():
    cfg = toy.ToyConfig()
    model = toy.make_model(cfg=cfg)
    tokens, labels = toy.make_batches(1, batch=2, seq=cfg.max_seq)[0]
    # The math backend spells attention as matmuls, which the counter sees (the fused
    # CPU kernel counts as 0). It computes the full s x s square, as the formula assumes.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    measured = counter.get_total_flops() / tokens.numel()
    total = sum(p.numel() for p in model.parameters())
    assert dense_params(model) == total - cfg.vocab * cfg.dim  # torchtitan's N: all but lookups
    # Norm scales do no matmul; leave them out too to compare exactly with the counter.
    n = dense_params(model, exclude=(torch.nn.Embedding, torch.nn.RMSNorm))
    assert n == total - cfg.vocab * cfg.dim - 5 * cfg.dim
    # The counter sees GQA's repeated k/v as full heads, the formula sees the weights: same.
    formula = flops_per_token(n, cfg.num_layers, cfg.dim, cfg.max_seq)
    assert formula == pytest.approx(measured, rel=1e-9)


def test_moe_active_params_and_mfu():
    # 8 experts of 100 params, top-2: a token uses 2/8 of the expert weights.
    assert moe_active_params(1000, 800, 8, 2) == 400
    with pytest.raises(ValueError, match="top_k=9"):
        moe_active_params(1000, 800, 8, 9)
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    ticks = iter([0.0, 2.0])
    meter = ThroughputMeter(flops_per_token=6e9, peak_flops=1e13, clock=lambda: next(ticks))
    stats = meter.update(2000)
    assert stats["tokens_per_s"] == 1000.0 and stats["mfu"] == pytest.approx(0.6)


def test_cpu_peak_is_measured_once():
    first = device.peak_flops(torch.device("cpu"), torch.float32)
    assert 1e8 < first < 1e14  # a real measurement, not a table entry
    assert device.peak_flops(torch.device("cpu"), torch.float32) == first  # cached


def test_deterministic_switch():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_seed(3, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)
