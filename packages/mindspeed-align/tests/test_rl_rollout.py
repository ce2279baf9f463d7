"""Rollouts on the generation engine, the recomputed log-probs, and the GRPO step in
two layouts (one process vs dp_shard=2) on the same fixed rollout."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from mindspeed_align.rl.objective import GRPOObjective, pack_samples, recompute_logps
from mindspeed_align.rl.rollout import LocalRollout, SamplingConfig, sampling_seed
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.step import TrainStep

PROMPTS = [[5, 17, 33, 9], [101, 7], [250, 251, 252, 253, 254, 3]]


def _policy(parallel: ParallelConfig, world_size=None):
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    dims = parallel.dims(world_size).build("cpu")
    return build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=32), dims


def _recomputed(policy, rollout, temperature):
    batch = pack_samples(rollout.prompt_ids, rollout.response_ids, {}, {},
                         agg="token-mean", max_new_tokens=8)  # fmt: skip
    logps = recompute_logps(policy, batch, temperature)
    # the output layer on the response positions alone gives the same values, zeros elsewhere
    responses_only = recompute_logps(policy, batch, temperature, supervised_only=True)
    torch.testing.assert_close(responses_only, logps, rtol=0, atol=1e-6)
    return logps[0][batch["labels"][0] != -100]


def _sampler(rollout):
    return torch.tensor([lp for row in rollout.sampler_logprobs for lp in row])


def test_rollout_logprobs_equal_the_trainers_recomputed_ones():
    policy, _ = _policy(ParallelConfig(), world_size=1)
    rollout = LocalRollout(policy)
    assert rollout.module is policy.model and rollout.sync_weights() == 0.0  # same module
    for temperature in (1.0, 0.7):
        cfg = SamplingConfig(n=3, max_new_tokens=8, temperature=temperature)
        batch = rollout.generate(PROMPTS, cfg, seed=sampling_seed(1, 0, 0))
        assert batch.group == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert batch.prompt_ids[3] == PROMPTS[1] and all(len(r) == 8 for r in batch.response_ids)
        # n samples of one prompt differ (sampled, not copied)
        assert len({tuple(r) for r in batch.response_ids[:3]}) > 1
        torch.testing.assert_close(_recomputed(policy, batch, temperature), _sampler(batch),
                                   rtol=0, atol=1e-5)  # fmt: skip
    cfg = SamplingConfig(n=2, max_new_tokens=6)
    again = [rollout.generate(PROMPTS, cfg, seed=sampling_seed(1, 5, r)).response_ids
             for r in (0, 0, 1)]  # fmt: skip
    assert again[0] == again[1] and again[0] != again[2]  # reproducible; dp ranks differ
    stop = rollout.generate(
        PROMPTS, SamplingConfig(n=4, max_new_tokens=30, stop_token_ids=tuple(range(512))), seed=3
    )
    assert all(len(r) == 1 for r in stop.response_ids) and all(stop.stopped)


def _fixed_rollout():
    """12 samples (4 prompts x 3) with made-up responses and advantages."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i in range(12):
        prompts.append(torch.randint(3, 512, (3 + i % 4,), generator=gen).tolist())
        responses.append(torch.randint(3, 512, (1 + (i * 5) % 7,), generator=gen).tolist())
    adv = torch.randn(12, generator=gen).tolist()
    return prompts, responses, adv


def _micro_batches(policy, prompts, responses, adv, agg, rows=None):
    """Packed micro-batches of the samples in `rows` (default: three consecutive each)."""
    batches = []
    for sl in rows or [list(range(lo, lo + 3)) for lo in range(0, len(prompts), 3)]:
        b = pack_samples([prompts[i] for i in sl], [responses[i] for i in sl],
                         {"advantages": [adv[i] for i in sl]}, {}, agg=agg, max_new_tokens=8)  # fmt: skip
        b["old_logps"] = recompute_logps(policy, b) - 0.4 * b["advantages"]  # off-policy
        b["ref_logps"] = recompute_logps(policy, b) + 0.05 * (b["labels"] % 3)
        batches.append(b)
    return batches


def _grpo_step(parallel, agg, world_size=None, rank=0, ranks=1, rows=None):
    policy, dims = _policy(parallel, world_size)
    parts = build_train_parts(policy, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    objective = GRPOObjective(eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3")
    step = TrainStep(parts, objective, dims, clip_grad=0.0)
    prompts, responses, adv = _fixed_rollout()
    per = len(prompts) // ranks
    mine = slice(rank * per, (rank + 1) * per)
    result = step(_micro_batches(policy, prompts[mine], responses[mine], adv[mine], agg, rows))
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in policy.model.named_parameters()}  # fmt: skip
    return result, grads, policy


def test_micro_batches_split_by_tokens_and_the_step_does_not_depend_on_the_split():
    """GRPOStep's micro-batches: `accum` parts of about equal tokens (the longest sample
    first onto the lightest part), each in sample order; the step's loss, metrics and
    gradients are those of the consecutive split (both loss aggregations)."""
    from types import SimpleNamespace

    from mindspeed_align.rl.grpo import GRPOStep

    prompts, responses, _ = _fixed_rollout()
    size = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    rows = GRPOStep._rows(SimpleNamespace(accum=4, share_prompts=False, cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_tokens=None))),
                          SimpleNamespace(prompt_ids=prompts, response_ids=responses),
                          list(range(12)))  # fmt: skip
    assert sorted(i for r in rows for i in r) == list(range(12)) and all(r == sorted(r) for r in rows)
    balanced = [sum(size[i] for i in r) for r in rows]
    consecutive = [sum(size[lo : lo + 3]) for lo in range(0, 12, 3)]
    assert max(balanced) - min(balanced) <= max(size)  # within one sample of each other
    assert max(balanced) < max(consecutive)  # the largest micro-batch shrinks
    for agg in ("token-mean", "seq-mean-token-mean"):
        (r1, g1, _), (r2, g2, _) = (_grpo_step(ParallelConfig(), agg, world_size=1, rows=split)
                                    for split in (None, rows))  # fmt: skip
        assert r2.num_units == r1.num_units and r2.loss == pytest.approx(r1.loss, rel=1e-6), agg
        for key in r1.metrics:
            assert r2.metrics[key] == pytest.approx(r1.metrics[key], rel=1e-5, abs=1e-7), (agg, key)
        for name, grad in g1.items():
            torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("masked", [False, True])
def test_shared_prompts_give_the_separate_samples_step(masked):
    """`grpo.shared_prompts`: 4 prompts x 3 samples, each prompt once per row and its samples
    attending to it: the recomputed log-probs, the step's loss, metrics and every gradient
    equal those of the samples packed whole (fp32), in fewer tokens; with environment masks
    (some response tokens unlabelled) too. GRPOStep keeps a prompt's samples together."""
    from types import SimpleNamespace

    from mindspeed_align.rl.grpo import GRPOStep

    gen = torch.Generator().manual_seed(1)
    groups = [torch.randint(3, 512, (2 + 3 * g,), generator=gen).tolist() for g in range(4)]
    prompts = [groups[i // 3] for i in range(12)]
    responses = [torch.randint(3, 512, (1 + (i * 5) % 7,), generator=gen).tolist() for i in range(12)]
    adv = torch.randn(12, generator=gen).tolist()
    masks = [[int(t % 3 != 0) for t in range(len(r))] for r in responses] if masked else None
    rows = GRPOStep._rows(SimpleNamespace(accum=2, share_prompts=True, cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_tokens=None))),
                          SimpleNamespace(prompt_ids=prompts, response_ids=responses), list(range(12)))  # fmt: skip
    assert all(len([i for i in r if i // 3 == g]) in (0, 3) for r in rows for g in range(4))  # groups whole
    results = []
    for share in (False, True):
        policy, dims = _policy(ParallelConfig(), 1)
        step = TrainStep(build_train_parts(policy, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2),
                         GRPOObjective(eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3"), dims,
                         clip_grad=0.0)  # fmt: skip
        micro = []
        for sl in rows:
            b = pack_samples([prompts[i] for i in sl], [responses[i] for i in sl],
                             {"advantages": [adv[i] for i in sl]}, {}, agg="seq-mean-token-mean",
                             max_new_tokens=8, share_prompts=share,
                             masks=None if masks is None else [masks[i] for i in sl])  # fmt: skip
            b["old_logps"] = recompute_logps(policy, b) - 0.4 * b["advantages"]
            b["ref_logps"] = recompute_logps(policy, b) + 0.05 * (b["labels"] % 3)
            micro.append(b)
        tokens = sum(b["input_ids"].numel() for b in micro)
        logps = [recompute_logps(policy, b)[b["labels"] != -100] for b in micro]
        result = step(micro)
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
        results.append((tokens, logps, result, grads))
    (t1, l1, r1, g1), (t2, l2, r2, g2) = results
    assert t2 < t1  # each prompt (but its last token) once per row
    for a, b in zip(l1, l2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert r2.num_units == r1.num_units and r2.loss == pytest.approx(r1.loss, rel=1e-5, abs=1e-7)
    for key in r1.metrics:
        assert r2.metrics[key] == pytest.approx(r1.metrics[key], rel=1e-5, abs=1e-6), key
    for name, grad in g1.items():
        torch.testing.assert_close(g2[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _layouts():
    import torch.distributed as dist

    out = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        one = _grpo_step(ParallelConfig(), agg, world_size=1)
        two = _grpo_step(ParallelConfig(dp_shard=2), agg, rank=dist.get_rank(), ranks=2)
        out[agg] = [(r.loss, r.num_units, r.metrics, g) for r, g, _ in (one, two)]
    # the FSDP policy rolls out through a gathered copy, trains, and rolls out again synced
    policy = two[2]
    rollout = LocalRollout(policy)
    diffs = []
    for _ in range(2):
        seconds = rollout.sync_weights()
        batch = rollout.generate(
            PROMPTS, SamplingConfig(n=2, max_new_tokens=6), seed=dist.get_rank()
        )
        diffs.append((_recomputed(policy, batch, 1.0) - _sampler(batch)).abs().max().item())
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(0.01)
    return out, diffs, rollout.copy, seconds


@pytest.mark.distributed
def test_grpo_step_dp_shard2_equals_one_process_and_fsdp_rolls_out_synced():
    for out, diffs, copied, seconds in run_distributed(_layouts, 2, timeout=600):
        assert copied and seconds > 0
        assert max(diffs) < 1e-5  # the copy follows the policy after every change
        for agg, ((loss1, units1, m1, g1), (loss2, units2, m2, g2)) in out.items():
            assert units1 == units2, agg
            assert loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-6), agg
            assert m1["clip_fraction"] > 0 and m1["kl"] > 0, agg  # the clip and KL are live
            for key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (agg, key)
            for name, grad in g1.items():
                torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _tp_layout():
    one = _grpo_step(ParallelConfig(), "seq-mean-token-mean", world_size=1)
    two = _grpo_step(ParallelConfig(tp=2), "seq-mean-token-mean")  # both ranks read it all
    rollout = LocalRollout(two[2])
    rollout.sync_weights()
    batch = rollout.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=6), seed=5)
    diff = (_recomputed(two[2], batch, 1.0) - _sampler(batch)).abs().max().item()
    return [(r.loss, r.num_units, r.metrics, g) for r, g, _ in (one, two)], diff, batch.response_ids


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_step_tp2_equals_one_process():
    ranks = run_distributed(_tp_layout, 2, timeout=600)
    assert ranks[0][2] == ranks[1][2]  # tensor-parallel peers draw the same samples
    for pairs, diff, _ in ranks:
        assert diff < 1e-5
        (loss1, units1, m1, g1), (loss2, units2, m2, g2) = pairs
        assert units1 == units2 and loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-6)
        for key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
        for name, grad in g1.items():
            torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_kv_budget_decodes_in_chunks_that_fit(monkeypatch):
    """`kv_budget_mb`: the prompts are decoded in chunks whose KV cache fits the budget; greedy
    tokens equal one batch's, sampled ones keep their log-probs; too small a budget is named."""
    from mindspeed_core.errors import ConfigError
    from mindspeed_llm.generation.kv_cache import KVCache

    policy, _ = _policy(ParallelConfig(), world_size=1)
    rollout = LocalRollout(policy)
    prompts = PROMPTS * 3  # 9 prompts
    length = max(len(p) for p in prompts) + 8
    per_prompt_mb = KVCache.bytes_per_position(policy.model) * length * 2 / 2**20  # n = 2
    budget = 4.5 * per_prompt_mb  # 4 prompts a chunk: 3 chunks
    caches = []
    real = KVCache.for_model.__func__
    monkeypatch.setattr(KVCache, "for_model", classmethod(
        lambda cls, model, batch, max_len: caches.append((batch, max_len)) or real(cls, model, batch, max_len)))  # fmt: skip
    greedy = dict(n=2, max_new_tokens=8, temperature=0.0)
    whole = rollout.generate(prompts, SamplingConfig(**greedy), seed=1)
    caches.clear()
    chunked = rollout.generate(prompts, SamplingConfig(**greedy, kv_budget_mb=budget), seed=1)
    assert chunked.response_ids == whole.response_ids and chunked.group == whole.group
    assert [b for b, _ in caches] == [4, 4, 1]  # prompts prefilled per chunk (then x n rows)
    assert all(2 * b * max_len * KVCache.bytes_per_position(policy.model) / 2**20 <= budget
               for b, max_len in caches)  # fmt: skip
    sampled = rollout.generate(prompts, SamplingConfig(n=2, max_new_tokens=8, kv_budget_mb=budget),
                               seed=3)  # fmt: skip
    torch.testing.assert_close(_recomputed(policy, sampled, 1.0), _sampler(sampled), rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"KV budget of .* MiB cannot hold one prompt's 2 samples"):
        rollout.generate(prompts, SamplingConfig(n=2, max_new_tokens=8, kv_budget_mb=per_prompt_mb / 2),
                         seed=1)  # fmt: skip
