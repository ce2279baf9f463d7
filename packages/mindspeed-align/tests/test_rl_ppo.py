"""`mindspeed ppo`: the value loss and packed GAE against their formulas, one PPO step (critic
and policy) under dp_shard=2 equal to one process on a fixed rollout, a short run with its
metrics and exact resume, and the bad inputs (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from mindspeed_align.reward import add_score_head
from mindspeed_align.rl.advantages import masked_whiten
from mindspeed_align.rl.cli import ppo_main
from mindspeed_align.rl.config import PPOSection
from mindspeed_align.rl.data import demo_records
from mindspeed_align.rl.losses import value_loss
from mindspeed_align.rl.objective import GRPOObjective, pack_samples, recompute_logps
from mindspeed_align.rl.ppo import (
    ValueObjective,
    packed_gae,
    ppo_advantages,
    recompute_values,
    whiten_over_ranks,
)
from mindspeed_core.cli import guarded
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.demo import ensure_demo_data
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.step import TrainStep

# -- formulas ----------------------------------------------------------------------------


def test_value_loss_table():
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -0.2, 0.2) - R)^2), worked by hand."""
    values = torch.tensor([1.0, 0.5, -0.2, 2.0, 0.0, 1.0])
    old = torch.tensor([0.8, 0.9, 0.0, 1.0, 0.5, 0.5])
    returns = torch.tensor([1.5, 0.0, -1.0, 1.1, 1.0, 1.0])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([0.125, 0.245, 0.32, 0.405, 0.5, 0.045]))
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    plain, _ = value_loss(values, old, returns, clip=None)
    torch.testing.assert_close(plain, 0.5 * (values - returns) ** 2)


def _gae_by_hand(rewards, values, gamma, lam):
    """The GAE recursion on one response, in plain Python."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_packed_gae_equals_the_recursion_per_response_and_whitening_spans_batches():
    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 21, 22, 23], [24], [25, 26]]
    batch = pack_samples(prompts, responses, {}, {}, agg="token-mean", max_new_tokens=4)
    shape = batch["labels"].shape
    rewards, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    adv, ret = packed_gae(rewards, values, batch, gamma=0.9, lam=0.8)
    positions = (batch["labels"][0] != -100).nonzero().flatten().tolist()
    start = 0
    for response in responses:
        span = positions[start : start + len(response)]
        start += len(response)
        want_adv, want_ret = _gae_by_hand(rewards[0, span].tolist(), values[0, span].tolist(), 0.9, 0.8)
        torch.testing.assert_close(adv[0, span], torch.tensor(want_adv))
        torch.testing.assert_close(ret[0, span], torch.tensor(want_ret))
    outside = batch["labels"][0] == -100
    assert (adv[0, outside] == 0).all() and (ret[0, outside] == 0).all()
    # whitening over two micro-batches = verl's masked_whiten over their response tokens
    other = pack_samples([[3, 4]], [[30, 31, 32]], {}, {}, agg="token-mean", max_new_tokens=4)
    other_adv = torch.randn(other["labels"].shape, generator=gen)
    batches = [{**batch, "advantages": adv.clone()}, {**other, "advantages": other_adv.clone()}]
    whiten_over_ranks(batches, "advantages", None)
    flat = torch.cat([adv[batch["labels"] != -100], other_adv[other["labels"] != -100]])
    want = masked_whiten(flat.double(), torch.ones_like(flat)).float()
    got = torch.cat([b["advantages"][b["labels"] != -100] for b in batches])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- one PPO step in two layouts -----------------------------------------------------------


def _fixed_rollout():
    """12 samples (made-up prompts, responses and scores)."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i in range(12):
        prompts.append(torch.randint(3, 512, (3 + i % 4,), generator=gen).tolist())
        responses.append(torch.randint(3, 512, (1 + (i * 5) % 7,), generator=gen).tolist())
    scores = torch.randint(0, 2, (12,), generator=gen).float().tolist()
    return prompts, responses, scores


def _ppo_step(parallel: ParallelConfig, world_size=None, rank=0, ranks=1):
    """Old values, GAE, a critic step and a policy step on this rank's share of the rollout."""
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    dims = parallel.dims(world_size).build("cpu")
    cpu = torch.device("cpu")
    policy = build_model(config, dims, cpu, parallel=parallel, seq_len=32)
    critic = build_model(config, dims, cpu, seq_len=32, before_tp=add_score_head,
                         parallel=dataclasses.replace(parallel, loss_parallel=False))  # fmt: skip
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    rl = PPOSection(kl_coef=0.1, gamma=0.95, lam=0.9)
    prompts, responses, scores = _fixed_rollout()
    per = len(prompts) // ranks
    micro = []
    for lo in range(rank * per, (rank + 1) * per, 3):
        rows = range(lo, lo + 3)
        b = pack_samples([prompts[i] for i in rows], [responses[i] for i in rows], {},
                         {"scores": [[0.0] * (len(responses[i]) - 1) + [scores[i]] for i in rows]},
                         agg="token-mean", max_new_tokens=8)  # fmt: skip
        b["old_logps"] = recompute_logps(policy, b) - 0.3 * (b["labels"] % 2)  # off-policy
        b["ref_logps"] = recompute_logps(policy, b) + 0.05 * (b["labels"] % 3)
        micro.append(b)
    kl = ppo_advantages(micro, lambda bs: [recompute_values(critic, b) for b in bs], rl,
                        dims.mesh("dp"))  # fmt: skip
    advantages = torch.cat([b["advantages"][b["labels"] != -100] for b in micro])
    critic_step = TrainStep(build_train_parts(critic, optim, total_steps=2), ValueObjective(0.2),
                            dims, clip_grad=0.0)  # fmt: skip
    policy_step = TrainStep(build_train_parts(policy, optim, total_steps=2),
                            GRPOObjective(eps_low=0.2, eps_high=0.28), dims, clip_grad=0.0)  # fmt: skip
    results = [critic_step(micro), policy_step(micro)]
    grads = [
        {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
         for n, p in m.model.named_parameters()}
        for m in (critic, policy)
    ]  # fmt: skip
    return [(r.loss, r.metrics) for r in results], grads, advantages, kl


def _layouts():
    import torch.distributed as dist

    one = _ppo_step(ParallelConfig(), world_size=1)
    two = _ppo_step(ParallelConfig(dp_shard=2), rank=dist.get_rank(), ranks=2)
    return one, two, dist.get_rank()


@pytest.mark.distributed
def test_ppo_step_dp_shard2_equals_one_process():
    for one, two, rank in run_distributed(_layouts, 2, timeout=600):
        (results1, grads1, adv1, kl1), (results2, grads2, adv2, _) = one, two
        assert kl1[1] > 0 and kl1[0] != 0  # the KL in the reward is live
        half = len(adv1) - len(adv2) if rank else 0  # rank 1 holds the second half
        torch.testing.assert_close(adv2, adv1[half : half + len(adv2)], rtol=1e-5, atol=1e-6)
        assert adv1.mean().abs() < 1e-5 and (adv1.std() - 1).abs() < 1e-2  # whitened
        for (loss1, m1), (loss2, m2), name in zip(results1, results2, ("critic", "policy"), strict=True):
            assert loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-6), name
            for key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (name, key)
        assert results1[0][1]["vf_clip_fraction"] == 0  # the first critic step is on-policy
        assert results1[1][1]["clip_fraction"] > 0  # the policy's clip is live
        for g1, g2 in zip(grads1, grads2, strict=True):
            for name, grad in g1.items():
                torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# -- the command ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppo")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(40, seed=7)))
    return folder, prompts, ensure_demo_data().tokenizer


def _args(task, run, *extra):
    folder, prompts, tokenizer = task
    return [
        f"--data.prompts={prompts}", f"--data.tokenizer={tokenizer}", "--data.eval_prompts=8",
        "--data.seq_len=48", "--ppo.n=2", "--ppo.max_new_tokens=3", "--ppo.reward_workers=0",
        "--train.global_batch=16", "--train.micro_batch=8", "--train.steps=4",
        "--critic.lr=3e-4", "--model.ops_impl=reference", f"--logging.run_dir={folder / run}",
        "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
        *extra,
    ]  # fmt: skip


def test_ppo_metrics_and_exact_resume(task):
    folder = task[0]
    assert guarded(ppo_main, _args(task, "whole")) == 0
    whole = read_metrics(folder / "whole" / "metrics.jsonl")
    assert [m["step"] for m in whole] == [1, 2, 3, 4]
    for key in ("critic/loss", "critic/grad_norm", "critic/values", "critic/returns",
                "critic/vf_clip_fraction", "kl", "reward/mean", "rollout/logprob_diff_max"):  # fmt: skip
        assert key in whole[0], key
    assert whole[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert whole[-1]["kl"] != 0  # ... and moves away from it
    assert max(m["rollout/logprob_diff_max"] for m in whole) < 1e-4
    assert whole[-1]["critic/loss"] < whole[0]["critic/loss"]  # the critic learns the returns
    # the critic's states are in the checkpoints: a resumed run repeats the same updates
    assert guarded(ppo_main, _args(task, "split", "--train.exit_at_step=2")) == 0
    assert guarded(ppo_main, _args(task, "split")) == 0
    split = read_metrics(folder / "split" / "metrics.jsonl")
    assert [m["step"] for m in split] == [1, 2, 3, 4]
    for a, b in zip(whole, split, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "kl", "critic/loss", "critic/values"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # what generate / convert read from the run is the policy, not the critic beside it
    from mindspeed_llm.loading import load_model

    policy, _ = load_model(folder / "whole" / "checkpoints")
    assert policy.output.weight.shape[0] == policy.config.vocab_size > 1


@pytest.mark.slow  # the scores: test_rl_rewards.py; the Ray test runs one in a ppo-style run
def test_ppo_with_a_reward_model(task):
    """`ppo.reward_model`: an exported classifier's score joins the rule reward in the run."""

    rewards_tests = import_sibling(__file__, "test_rl_rewards")
    folder, _, tokenizer = task
    rm = rewards_tests._reward_model_folder(folder, tokenizer)
    args = _args(task, "with_rm", f"--ppo.reward_model={rm}", "--ppo.reward_model_weight=0.5",
                 "--train.steps=1")  # fmt: skip
    assert guarded(ppo_main, args) == 0
    (first,) = read_metrics(folder / "with_rm" / "metrics.jsonl")
    assert first["reward/model"] != 0
    assert first["reward/mean"] == pytest.approx(
        first["reward/final_number"] + 0.5 * first["reward/model"], abs=1e-6
    )
    # `critic.init_from`: the critic starts as that reward model (body and value head), so its
    # first values differ from a critic with a new head on the policy's body
    assert guarded(ppo_main, _args(task, "critic_rm", f"--critic.init_from={rm}",
                                   "--train.steps=1")) == 0  # fmt: skip
    assert guarded(ppo_main, _args(task, "critic_new", "--train.steps=1")) == 0
    (from_rm,) = read_metrics(folder / "critic_rm" / "metrics.jsonl")
    (fresh,) = read_metrics(folder / "critic_new" / "metrics.jsonl")
    assert from_rm["critic/values"] != pytest.approx(fresh["critic/values"], abs=1e-6)


def test_ppo_bad_inputs_are_one_line(task, capsys):
    folder = task[0]
    cases = {
        "--parallel.cp=2": "mindspeed ppo rolls out whole sequences",
        "--critic.value_clip=0": "critic.value_clip=0",
        "--ppo.lam=1.5": "ppo.lam=1.5",
        "--ppo.n=3": "not a whole number of groups of ppo.n=3",
        f"--ppo.reward_model={folder}": "ppo.reward_model: ",
        f"--critic.init_from={folder / 'no_such'}": f"critic.init_from={folder / 'no_such'} does "
        "not exist",
        f"--critic.init_from={folder}": "critic.init_from: ",  # not an exported reward model
    }
    for arg, expected in cases.items():
        assert guarded(ppo_main, [*_args(task, "bad"), arg]) == 2, arg
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, (arg, err)
    assert guarded(ppo_main, [*_args(task, "bad"), "--ppo.advantage=rloo", "--ppo.n=1",
                              "--train.global_batch=8"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "ppo.n=1: group advantages (ppo.advantage=rloo)" in err and "\n" not in err, err
    assert not (folder / "bad").exists()  # nothing half-written


@pytest.mark.slow
def test_ppo_demo_reward_rises(tmp_path):
    """The embedded demo (a few minutes): the held-out reward rises above 0.8."""
    from mindspeed_align.rl.cli import ppo
    from mindspeed_align.rl.config import PPOConfig, PPOLoggingSection

    cfg = PPOConfig(logging=PPOLoggingSection(run_dir=tmp_path / "ppo", progress=False))
    summary = ppo(cfg)
    (_, sampled0), (greedy1, sampled1) = summary["reward_before"], summary["reward_after"]
    assert sampled1 > 0.8 and sampled1 > sampled0 + 0.3, summary
    assert greedy1 > 0.8, summary
