"""Several updates per rollout (`grpo.epochs`, `grpo.mini_batches`; PPO's the same): the
old log-probs are fixed before the first update, so the second epoch's ratio moves off 1,
and its loss equals the clipped surrogate computed here by hand from the policy as the
first update left it; mini-batches split the samples and the LR schedule moves once per
rollout; one epoch of one mini-batch is today's single update. One-step off-policy
(`grpo.async_rollout`): the next step's samples are drawn while this step trains, and the
loss's ratio is against the sampler's log-probs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mindspeed_align.rl.config import GRPOConfig, GRPOSection
from mindspeed_align.rl.grpo import GRPOStep
from mindspeed_align.rl.objective import GRPOObjective
from mindspeed_align.rl.rollout import RolloutBatch
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# two prompts, two samples each; rewards 1/0 per group: advantages +-0.707 (grpo, n=2)
PROMPTS = [[5, 9, 14], [5, 9, 14], [7, 3, 22, 8], [7, 3, 22, 8]]
RESPONSES = [[31, 40, 2], [12, 6], [44, 45, 46, 47], [19, 3]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


class _FixedRollout:
    """Stands in for the sampler: the same samples every step."""

    def sync_weights(self) -> float:
        return 0.0

    def generate(self, prompts, sampling, seed):
        return RolloutBatch(
            prompt_ids=PROMPTS, response_ids=RESPONSES,
            sampler_logprobs=[[-1.0] * len(r) for r in RESPONSES], group=[0, 0, 1, 1],
            stopped=[True] * len(RESPONSES),
        )  # fmt: skip


class _FixedRewards:
    def __call__(self, prompts, completions, columns):
        return list(REWARDS), {"reward/failures": 0.0}


class _Tokenizer:
    eod_id = None

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def _step(epochs: int, mini_batches: int, **options):
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    dims = ParallelConfig().dims(1).build("cpu")
    torch.manual_seed(0)
    policy = build_model(config, dims, torch.device("cpu"), parallel=ParallelConfig(), seq_len=32)
    start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    optim = OptimConfig(lr=2e-2, warmup_steps=0, weight_decay=0.0)
    parts = build_train_parts(policy, optim, total_steps=10)
    rl = GRPOSection(n=2, epochs=epochs, mini_batches=mini_batches, clip_low=CLIP_LOW,
                     clip_high=CLIP_HIGH, max_new_tokens=4, reward_workers=0, **options)  # fmt: skip
    cfg = dataclasses.replace(GRPOConfig(), grpo=rl)
    objective = GRPOObjective.from_section(rl)
    step = GRPOStep(parts, objective, dims, cfg=cfg, tokenizer=_Tokenizer(),
                    rewards=_FixedRewards(), clip_grad=0.0)  # fmt: skip
    step.rollout = _FixedRollout()
    # the weights each training forward (grad enabled) starts from
    seen = []
    policy.model.register_forward_pre_hook(
        lambda module, args: seen.append(
            {k: v.detach().clone() for k, v in module.state_dict().items()}
        ) if torch.is_grad_enabled() else None
    )  # fmt: skip
    records = [{"prompt": "a", "prompt_ids": PROMPTS[0]}, {"prompt": "b", "prompt_ids": PROMPTS[2]}]
    return step, policy, records, start, seen


def _logps(policy, weights) -> list[torch.Tensor]:
    """Each sample's response-token log-probs, one plain forward per sample."""
    model = policy.model
    keep = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    out = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES, strict=True):
            ids = torch.tensor([p + r])
            logits = model(ids).float()[0, len(p) - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    model.load_state_dict(keep)
    return out


def _surrogate(new: list[torch.Tensor], old: list[torch.Tensor]) -> tuple[float, float]:
    """(token-mean clipped surrogate, mean ratio), by hand: GRPO's advantage per group of 2
    is +-1/sqrt(2) (std of {0, 1} is 1/sqrt(2) unbiased), spread over each response."""
    adv = [1 / math.sqrt(2) if r else -1 / math.sqrt(2) for r in REWARDS]
    losses, ratios = [], []
    for n, o, a in zip(new, old, adv, strict=True):
        ratio = torch.exp(n.double() - o.double())
        clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
        losses.append(-torch.minimum(ratio * a, clipped * a))
        ratios.append(ratio)
    return torch.cat(losses).mean().item(), torch.cat(ratios).mean().item()


def test_one_epoch_of_one_mini_batch_is_the_single_on_policy_update():
    step, policy, records, start, seen = _step(epochs=1, mini_batches=1)
    result = step(records)
    old = _logps(policy, start)
    loss, ratio = _surrogate(old, old)
    assert result.loss == pytest.approx(loss, abs=1e-6)
    assert result.metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert len(seen) == 1 and not any(k.startswith("loss/epoch") for k in result.metrics)


@pytest.mark.parametrize("share", [False, True], ids=["whole", "shared_prompts"])
def test_second_epoch_ratio_moves_and_its_loss_is_the_hand_computed_surrogate(share):
    """With shared prompts too (each group's prompt once in the row): the same hand values
    from plain per-sample forwards, through `_per_sample`'s scatter and the re-packing."""
    step, policy, records, start, seen = _step(epochs=2, mini_batches=1)
    step.share_prompts = share
    result = step(records)
    assert len(seen) == 2  # one training forward per update
    old = _logps(policy, start)  # fixed before the first update
    first, ratio1 = _surrogate(_logps(policy, seen[0]), old)
    second, ratio2 = _surrogate(_logps(policy, seen[1]), old)
    assert ratio1 == pytest.approx(1.0, abs=1e-6)
    assert abs(ratio2 - 1.0) > 1e-3  # the policy moved: the ratio is off 1
    m = result.metrics
    assert m["loss/epoch_1"] == pytest.approx(first, abs=1e-6)
    assert m["loss/epoch_2"] == pytest.approx(second, abs=1e-6)
    assert m["ratio/epoch_2"] == pytest.approx(ratio2, abs=1e-6)
    assert result.loss == pytest.approx((first + second) / 2, abs=1e-6)
    assert "clip_fraction/epoch_2" in m and "kl/epoch_1" in m
    assert step.parts.scheduler.schedulers[0].last_epoch == 1  # the LR schedule counts rollouts


def test_mini_batches_split_the_samples_and_each_update_sees_the_moved_policy():
    step, policy, records, start, seen = _step(epochs=1, mini_batches=2)
    result = step(records)
    assert len(seen) == 2
    assert result.num_units == 3 + 2 + 4 + 2  # each response token once over the pass
    assert not torch.equal(seen[0]["layers.0.attention.wq.weight"],
                           seen[1]["layers.0.attention.wq.weight"])  # fmt: skip
    assert step.parts.scheduler.schedulers[0].last_epoch == 1


class _MismatchedRollout(_FixedRollout):
    """`_FixedRollout` whose sampler log-probs are the given ones (a sampler off the trainer)."""

    def __init__(self, sampler: list[list[float]]):
        self.sampler = sampler

    def generate(self, prompts, sampling, seed):
        batch = super().generate(prompts, sampling, seed)
        return dataclasses.replace(batch, sampler_logprobs=self.sampler)


def _mismatched_step(**options):
    """`_step` with a TIS cap of 2 and a sampler whose log-probs are the starting policy's
    minus 1.0 or plus 0.3 on alternate tokens (weights e^1 = 2.7, capped, and e^-0.3);
    returns it, its records, the old log-probs and sampler ones, flat, and the advantages."""
    step, policy, records, start, seen = _step(rollout_correction_cap=2.0, **options)
    old = _logps(policy, start)
    sampler = [[x + (-1.0 if t % 2 == 0 else 0.3) for t, x in enumerate(o.tolist())] for o in old]
    step.rollout = _MismatchedRollout(sampler)
    adv = torch.cat([torch.full((len(r),), (1 if w else -1) / math.sqrt(2), dtype=torch.float64)
                     for r, w in zip(RESPONSES, REWARDS, strict=True)])  # fmt: skip
    flat = torch.tensor([x for row in sampler for x in row], dtype=torch.float64)
    return step, records, torch.cat(old).double(), flat, adv


def test_rollout_correction_weighs_each_token_by_the_capped_sampler_ratio():
    """`grpo.rollout_correction_cap`: the on-policy loss (ratio 1, -A per token) times
    min(exp(old - sampler), cap) per token; the mismatch metrics are of the same numbers."""
    step, records, old, sampler, adv = _mismatched_step(epochs=1, mini_batches=1)
    result = step(records)
    weights = torch.exp(old - sampler).clamp(max=2.0)
    assert (weights < 2.0).any() and (weights == 2.0).any()  # the cap is live on some tokens
    assert result.loss == pytest.approx((-adv * weights).mean().item(), abs=1e-6)
    m = result.metrics
    diff = (old - sampler).abs().mean().item()
    assert m["rollout/logprob_diff_mean"] == pytest.approx(diff, abs=1e-6)
    k3 = torch.exp(old - sampler) - (old - sampler) - 1  # KL(sampler || trainer), k3 estimate
    assert m["rollout/logprob_kl_k3"] == pytest.approx(k3.mean().item(), abs=1e-6)
    assert m["rollout/is_capped_fraction"] == pytest.approx((weights == 2.0).double().mean().item())


@pytest.mark.parametrize("epochs", [1, 2])
def test_rollout_correction_reaches_every_update(epochs):
    """With old log-probs recomputed (and several updates), the sampler's log-probs stay in
    the batches: the first update's loss is the hand-weighted one."""
    step, records, old, sampler, adv = _mismatched_step(epochs=epochs, mini_batches=1,
                                                        recompute_old_logps=True)  # fmt: skip
    result = step(records)
    want = (-adv * torch.exp(old - sampler).clamp(max=2.0)).mean().item()
    assert result.metrics.get("loss/epoch_1", result.loss) == pytest.approx(want, abs=1e-6)


def test_gspo_second_epoch_is_the_hand_computed_sequence_loss():
    """`grpo.loss gspo` through the step: the second update's loss is GSPO's by hand,
    mean over the 4 responses of -min(s_i A_i, clip(s_i) A_i), s_i the exp of the mean
    log-ratio over response i (the clip range 0.2 / 0.28 given, so that it is not all
    clipped)."""
    step, policy, records, start, seen = _step(epochs=2, mini_batches=1, loss="gspo")
    result = step(records)
    old, new = _logps(policy, start), _logps(policy, seen[1])
    losses = []
    for n, o, r in zip(new, old, REWARDS, strict=True):
        a = (1 if r else -1) / math.sqrt(2)
        s = math.exp((n.double() - o.double()).mean().item())
        losses.append(-min(s * a, min(max(s, 1 - CLIP_LOW), 1 + CLIP_HIGH) * a))
    assert abs(math.exp((new[0] - old[0]).double().mean().item()) - 1) > 1e-3  # s moved off 1
    assert result.metrics["loss/epoch_2"] == pytest.approx(sum(losses) / 4, abs=1e-6)


def test_bad_epochs_and_mini_batches_name_the_field():
    from mindspeed_core.errors import ConfigError

    for field, value in (("epochs", 0), ("mini_batches", -1)):
        with pytest.raises(ConfigError, match=f"grpo.{field}={value} must be >= 1"):
            GRPOSection(**{field: value})


def test_ppo_command_with_two_epochs_of_two_mini_batches(tmp_path):
    """`mindspeed ppo --ppo.epochs 2 --ppo.mini_batches 2`: a critic and a policy update
    per mini-batch; the per-epoch metrics are logged and the second epoch's ratio is off 1."""
    import json

    from mindspeed_align.rl.cli import ppo_main
    from mindspeed_align.rl.data import demo_records
    from mindspeed_core.cli import guarded
    from mindspeed_core.training import read_metrics
    from mindspeed_llm.demo import ensure_demo_data

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(16, seed=7)))
    args = [
        f"--data.prompts={prompts}", f"--data.tokenizer={ensure_demo_data().tokenizer}",
        "--data.eval_prompts=0", "--data.seq_len=48", "--ppo.n=2", "--ppo.max_new_tokens=3",
        "--ppo.reward_workers=0", "--ppo.epochs=2", "--ppo.mini_batches=2",
        "--train.global_batch=8", "--train.micro_batch=8", "--train.steps=2",
        "--model.ops_impl=reference", f"--logging.run_dir={tmp_path / 'run'}",
        "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
    ]  # fmt: skip
    assert guarded(ppo_main, args) == 0
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["ratio/epoch_1"] == pytest.approx(1.0, abs=0.05)  # first update: mostly 1
        assert abs(m["ratio/epoch_2"] - 1.0) > 1e-4
        assert math.isfinite(m["critic/loss"]) and "clip_fraction/epoch_2" in m


class _LoggedRollout(_FixedRollout):
    """`_FixedRollout` that notes which step's seed each rollout drew with, and the weights
    its module held then (a copy, as off-policy rollouts use)."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []
        self.module_weights = None

    def sync_weights(self) -> float:
        self.module_weights = {k: v.detach().clone() for k, v in self.policy.model.state_dict().items()}
        return 0.0

    def generate(self, prompts, sampling, seed):
        self.calls.append((seed, self.module_weights))
        return super().generate(prompts, sampling, seed)


class _Prompts:
    def __init__(self, records):
        self.records = records

    def peek(self):
        return self.records


def test_one_step_off_policy_trains_on_samples_of_the_policy_one_update_old():
    """Step 1 samples first (nothing was prefetched), then starts step 2's rollout with the
    weights step 1 starts from; step 2 trains on those samples, its ratio against the
    sampler's log-probs (-1 here), so its loss is the clipped surrogate of the weights step
    1 left over those log-probs, by hand (1e-6)."""
    from mindspeed_align.rl.rollout import sampling_seed

    step, policy, records, start, seen = _step(epochs=1, mini_batches=1, async_rollout="one_step")
    step.rollout = _LoggedRollout(policy)
    step.source = _Prompts(records)
    first = step(records)
    step.state.step += 1
    after_first = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    second = step(records)
    step.settle()
    sampler = [torch.full((len(r),), -1.0) for r in RESPONSES]
    loss1, ratio1 = _surrogate(_logps(policy, start), sampler)
    loss2, ratio2 = _surrogate(_logps(policy, after_first), sampler)
    assert first.loss == pytest.approx(loss1, abs=1e-6) and second.loss == pytest.approx(loss2, abs=1e-6)
    assert second.metrics["ratio"] == pytest.approx(ratio2, rel=1e-5) and abs(ratio2 - ratio1) > 1e-3
    assert (first.metrics["rollout/staleness"], second.metrics["rollout/staleness"]) == (0.0, 1.0)
    # rollouts: step 1's (sampled first), step 2's (started during step 1, with the weights
    # step 1 began from) and step 3's (during step 2, with the weights step 1 left)
    seeds = [sampling_seed(GRPOConfig().train.seed, k, 0) for k in range(3)]
    assert [seed for seed, _ in step.rollout.calls] == seeds
    for (_, weights), expected in zip(step.rollout.calls[1:], (start, after_first), strict=True):
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
