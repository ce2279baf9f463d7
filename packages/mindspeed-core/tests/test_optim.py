"""Optimizer container, LR schedules, clipping across pipeline stages, fp16 loss scaling."""

import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import (
    DynamicLossScaler,
    build_lr_schedulers,
    build_optimizers,
    clip_grad_norm_,
    lr_multiplier,
    param_groups,
)
from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import import_sibling, run_distributed

toy = import_sibling(__file__, "toy")


def _curve(style, steps=10, **kwargs):
    return [
        lr_multiplier(s, warmup_steps=2, total_steps=steps, decay_style=style, **kwargs)
        for s in range(steps + 2)
    ]


def test_schedule_shapes():
    cosine = _curve("cosine", min_lr_ratio=0.1)
    assert cosine[:2] == [0.5, 1.0]  # linear warmup reaches the peak on its last step
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert cosine[10] == pytest.approx(0.1) and cosine[11] == pytest.approx(0.1)  # then holds
    linear = _curve("linear")
    assert linear[6] == pytest.approx(0.5) and linear[10] == 0.0
    assert _curve("constant")[2:] == [1.0] * 10
    wsd = _curve("wsd", decay_steps=4, min_lr_ratio=0.0)
    assert wsd[2:7] == [1.0] * 5  # stable until the last 4 steps
    assert wsd[7:11] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert all(b <= a for a, b in zip(cosine[1:], cosine[2:], strict=False))


def _lrs(optimizer, scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.optimizers[0].param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_a_resumed_schedule_continues_on_the_same_curve():
    def fresh():
        opt = build_optimizers(toy.make_model(), lr=1e-3)
        return opt, build_lr_schedulers(opt, warmup_steps=3, total_steps=12, min_lr_ratio=0.1)

    opt, sched = fresh()
    head = _lrs(opt, sched, 5)
    state = sched.state_dict()
    tail = _lrs(opt, sched, 7)
    opt2, sched2 = fresh()
    sched2.load_state_dict(state)
    assert _lrs(opt2, sched2, 7) == tail
    assert head[0] == pytest.approx(1e-3 / 3) and tail[-1] < tail[0]


def test_weight_decay_skips_vectors():
    decay, no_decay = param_groups(toy.make_model(), 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 5
    opt = build_optimizers(toy.make_model(), lr=1e-3)
    assert opt.optimizers[0].defaults["foreach"] is True  # CPU: foreach, not fused


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda o: build_optimizers(toy.make_model(), lr=0), r"optim\.lr=0 must be a positive"),
        (lambda o: build_optimizers(toy.make_model(), lr=float("nan")), r"optim\.lr=nan must"),
        (
            lambda o: build_optimizers(toy.make_model(), lr=1, betas=(2.0, 0.9)),
            r"optim\.betas=\[2\.0, 0\.9\] must be two numbers in \[0, 1\)",
        ),
        (lambda o: build_optimizers(toy.make_model(), lr=1, eps=-1), r"optim\.eps=-1 must"),
        (
            lambda o: build_optimizers(toy.make_model(), lr=1, weight_decay=float("inf")),
            r"optim\.weight_decay=inf must",
        ),
        (
            lambda o: build_optimizers(toy.make_model(), lr=1, implementation="fast"),
            "implementation 'fast'",
        ),
        (
            lambda o: build_lr_schedulers(o, warmup_steps=1, total_steps=5, decay_style="cos"),
            "'cos'",
        ),
        (lambda o: build_lr_schedulers(o, warmup_steps=9, total_steps=5), "warmup_steps=9 exceeds"),
        (
            lambda o: build_lr_schedulers(o, warmup_steps=1, total_steps=5, min_lr_ratio=2),
            r"min_lr_ratio=2 must lie in \[0, 1\]",
        ),
        (
            lambda o: build_lr_schedulers(o, warmup_steps=1, total_steps=5, decay_steps=9),
            "decay_steps=9",
        ),
    ],
)
def test_bad_optimizer_settings(build, message):
    with pytest.raises(ConfigError, match=message):
        build(build_optimizers(toy.make_model(), lr=1e-3))


def test_loss_scaler_backs_off_with_hysteresis_and_grows_again():
    scaler = DynamicLossScaler(init_scale=1024, growth_interval=3, hysteresis=2)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([2048.0, 1024.0, float("inf")])
    assert scaler.unscale_([p]) is True
    scaler.update(True)
    assert scaler.scale == 1024  # first overflow forgiven (hysteresis 2)
    scaler.update(True)
    assert scaler.scale == 512
    p.grad = torch.tensor([512.0, 0.0, -512.0])
    assert scaler.unscale_([p]) is False and p.grad.tolist() == [1.0, 0.0, -1.0]
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 1024
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


def _grads_of(model):
    tokens, labels = toy.make_batches(1)[0]
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()


def _stage_clip_and_scaler():
    """Two pipeline stages each hold half the parameters; the clip sees all of them."""
    dims = ParallelDims(pp=2).build()
    model = toy.make_model()
    _grads_of(model)
    mine = [p for i, p in enumerate(model.parameters()) if i % 2 == dims.rank("pp")]
    norm2 = clip_grad_norm_(mine, 0.5, pp_mesh=dims.mesh("pp"))
    norm_inf = clip_grad_norm_(mine, 0.0, math.inf, pp_mesh=dims.mesh("pp"))
    clipped = {
        n: p.grad.clone()
        for i, (n, p) in enumerate(model.named_parameters())
        if i % 2 == dims.rank("pp")
    }
    scaler = DynamicLossScaler()
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan") if dims.rank("pp") == 1 else 1.0])
    return norm2, norm_inf, clipped, scaler.unscale_([p])


@pytest.mark.distributed
def test_clipping_and_overflow_checks_span_pipeline_stages():
    model = toy.make_model()
    _grads_of(model)
    ref_inf = max(p.grad.abs().max() for p in model.parameters())
    ref_norm = clip_grad_norm_(model.parameters(), 0.5)
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert ref_norm > 0.5
    seen = {}
    for norm2, norm_inf, clipped, found_inf in run_distributed(_stage_clip_and_scaler, 2):
        torch.testing.assert_close(norm2, ref_norm, atol=1e-6, rtol=0)
        torch.testing.assert_close(norm_inf, ref_inf * 0.5 / ref_norm, atol=1e-6, rtol=1e-6)
        assert found_inf is True  # only stage 1 saw the nan
        seen.update(clipped)
    assert seen.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(seen[name], grad, atol=1e-7, rtol=0)
