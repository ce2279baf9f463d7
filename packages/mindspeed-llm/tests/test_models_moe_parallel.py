"""Expert parallel gives one process's losses, gradients and updated weights (fp32, gloo):
Mixtral debug with dp_shard=2, ep=2 (every rank holds different experts) and dp_shard=4,
ep=2 (experts also FSDP-sharded over dp_shard_mod_ep), a few AdamW steps with the aux loss;
and bad layouts are refused before any process group exists."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.optim import build_optimizers, clip_grad_norm_
from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common.moe_stats import active_params, moe_aux_loss

RTOL = 1e-4
STEPS = 3


def _batches(world):
    gen = torch.Generator().manual_seed(1)
    return [
        [torch.randint(0, 512, (2, 17), generator=gen) for _ in range(world)] for _ in range(STEPS)
    ]


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _loss(model, batch):
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    return loss + moe_aux_loss(model, model.config)


def _train(world, degrees, rank, family, changes, options):
    """Losses, grads and final weights; degrees None: one process over all ranks' batches."""
    spec = get_model_spec(family)
    config = build_model_config(family, flavor="debug", router_z_loss_coef=1e-3, **changes)
    torch.manual_seed(0)
    model = spec.build(config)
    if degrees is not None:
        model = spec.parallelize(model, ParallelDims(**degrees).build(), **options)
    opt = build_optimizers(model, lr=1e-3, implementation="for-loop")
    losses, grads = [], []
    for step_batches in _batches(world):
        opt.zero_grad()
        if degrees is None:
            loss = sum(_loss(model, b) for b in step_batches) / world
            loss.backward()
            loss = loss.detach()
        else:
            loss = _loss(model, step_batches[rank])
            loss.backward()
            loss = loss.detach()
            dist.all_reduce(loss)
            loss /= world
        clip_grad_norm_(list(model.parameters()), 1.0)
        losses.append(loss.item())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
    weights = {n: _full(p) for n, p in model.named_parameters()}
    experts = model.layers["0"].feed_forward.experts.w1
    return losses, grads, weights, isinstance(experts, DTensor) and experts.placements


def _compare(world, degrees, family="mixtral", changes=None, options=None):
    rank, changes, options = dist.get_rank(), changes or {}, options or {}
    ref_losses, ref_grads, ref_weights, _ = _train(world, None, rank, family, changes, options)
    losses, grads, weights, placements = _train(world, degrees, rank, family, changes, options)
    assert Shard(0) in placements
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    for step in range(STEPS):
        # After an AdamW step the weights differ in the last bits (see below), so the later
        # gradients get a looser absolute tolerance than the first.
        atol = 1e-6 if step == 0 else 1e-5
        for name in ref_grads[step]:
            torch.testing.assert_close(
                grads[step][name],
                ref_grads[step][name],
                rtol=RTOL,
                atol=atol,
                msg=lambda m, n=name, s=step: f"step {s} {n}: {m}",
            )
    # AdamW turns a near-zero gradient's last-bit difference into a step of up to lr, so
    # the weights get an absolute tolerance of lr * 1e-2 on top.
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=RTOL, atol=1e-5)
    return losses


def test_ep2_over_dp_shard2_matches_one_process():
    results = run_distributed(_compare, 2, 2, {"dp_shard": 2, "ep": 2}, timeout=300)
    assert results[0] == results[1]


@pytest.mark.slow
def test_ep2_inside_dp_shard4_matches_one_process():
    run_distributed(_compare, 4, 4, {"dp_shard": 4, "ep": 2}, timeout=300)


def test_qwen2_moe_ep2_with_capacity_and_full_recompute_matches_one_process():
    """The shared expert, token dropping and the all-to-alls re-run in backward."""
    run_distributed(
        _compare,
        2,
        2,
        {"dp_shard": 2, "ep": 2},
        "qwen2_moe",
        {"capacity_factor": 1.0},
        {"ac_mode": "full"},
        timeout=300,
    )


def test_bad_ep_layouts_refused_before_any_group():
    assert not dist.is_initialized()
    with pytest.raises(ParallelError, match=r"ep=3 must divide dp_shard x cp = 4"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)


@pytest.mark.parametrize(
    ("family", "parallel", "message"),
    [
        ("mixtral", {"ep": 3}, "parallel.ep=3 must divide the model's num_experts=4"),
        ("llama", {"ep": 2}, "parallel.ep=2 needs a MoE model"),
        ("mixtral", {"ep": 2, "dp_replicate": 2}, "parallel.dp_replicate=2 is not supported"),
    ],
)
def test_pretrain_refuses_moe_layouts_it_does_not_build(family, parallel, message):
    from mindspeed_core.parallel import ParallelConfig
    from mindspeed_llm.models.common.layout import check_layout

    with pytest.raises(ConfigError, match=message):
        check_layout(build_model_config(family, flavor="debug"), ParallelConfig(**parallel))
    assert not dist.is_initialized()


def test_flops_count_only_the_experts_a_token_uses():
    spec = get_model_spec("mixtral")
    with torch.device("meta"):
        model = spec.build(spec.flavors["mixtral-8x7b"])
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    # Mixtral-8x7B: 46.7B parameters, 12.9B used per token (embedding included)
    assert active_params(model) + embedding == pytest.approx(12.88e9, rel=2e-3)
    assert active_params(model) < total - embedding
