"""`mindspeed grpo`: GRPO (and Dr.GRPO, RLOO, REINFORCE++, DAPO's pieces) with rule
rewards, colocated on one machine, on the shared engine (`mindspeed_llm.train`).

One optimizer step = one rollout:

    sync the rollout module from the policy (timed; nothing to do when it is the policy)
    sample grpo.n completions of this rank's prompts (seeds differ across dp ranks)
    rewards (worker processes, timeout) -> advantages -> [drop zero-variance groups]
    pack into micro-batches; old log-probs recomputed by the policy (teacher-forced),
    reference log-probs when grpo.kl_coef > 0
    TrainStep on GRPOObjective (grpo.loss: the clipped surrogate, GSPO, CISPO; + KL; times
    TIS weights with grpo.rollout_correction_cap; aggregated by grpo.loss_agg),
    or grpo.epochs passes of grpo.mini_batches updates on the same samples (`updates`)

With `grpo.async_rollout` (one_step, bounded) the rollouts sample in a background thread
while steps train, handed out by a scheduler of `async_rollout.py`.

`GRPOStep` is a `TrainStep` whose input is the prompts; `TrainLoop` runs it unchanged
(metrics.jsonl, checkpoints, exact resume: the sampling seed is derived from the step).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_align.common import shares_prompts
from mindspeed_align.rl import advantages as adv_fns
from mindspeed_align.rl.async_rollout import STALENESS_COUNTS, BoundedRollouts, OneStepRollouts
from mindspeed_align.rl.config import GRPOConfig
from mindspeed_align.rl.env import run_episodes
from mindspeed_align.rl.evaluate import evaluate_episodes, evaluate_reward
from mindspeed_align.rl.lora import BaseReference
from mindspeed_align.rl.objective import GRPOObjective, Mismatch, pack_samples, recompute_logps
from mindspeed_align.rl.placement import LocalReference
from mindspeed_align.rl.rewards import FAILURE_COUNTS, Rewards
from mindspeed_align.rl.rollout import LocalRollout, RolloutBatch, SamplingConfig, sampling_seed
from mindspeed_core.errors import ConfigError
from mindspeed_llm.data.collate import IGNORE_INDEX, SHARED_KEYS
from mindspeed_llm.data.token_budget import equalise, plan_micro_batches
from mindspeed_llm.train.objectives import RunContext
from mindspeed_llm.train.step import StepResult, TrainStep, supervised_positions_layout

logger = logging.getLogger("mindspeed.grpo")

__all__ = ["GRPOMethod", "GRPOStep", "evaluate_episodes", "evaluate_reward"]

ENV_COUNTS = ("env/errors", "env/over_budget")
"""Episode counts of the step (every rank's summed)."""


class GRPOStep:
    """The run's step: takes this rank's prompt records, rolls out, and trains with the
    engine's `TrainStep` (held as `train`, not subclassed: every update is one call of it).
    `parts`, `model`, `objective`, `dims`, `state` and `evaluate` are the held step's, for
    the loop."""

    def __init__(self, parts, objective, dims, *, cfg: GRPOConfig, tokenizer, rewards: Rewards,
                 reference=None, accum: int = 1, env=None, template=None, source=None,
                 rollout=None, **kwargs):  # fmt: skip
        self.train = TrainStep(parts, objective, dims, **kwargs)
        self.parts, self.model, self.objective, self.dims = parts, parts.model, objective, dims
        self.cfg, self.rl, self.tokenizer, self.rewards = cfg, cfg.rl, tokenizer, rewards
        self.env, self.template = env, template  # multi-turn episodes (`env.run_episodes`)
        self.reference, self.accum = reference, accum
        # asynchronous rollouts sample in a thread on a copy of the policy (`async_rollout`)
        self.off_policy = getattr(cfg.rl, "async_rollout", "off") != "off"
        self.source = source  # the prompts (`peek` gives the next steps')
        # the rollout: a role placed elsewhere (`placement.RayRoles.rollout`) or on this rank
        self.rollout = rollout or LocalRollout(parts.model, copy=self.off_policy, lora=cfg.lora)
        self.async_rollouts = None  # made on the first step, with the rollout and source as set then
        stops = () if tokenizer.eod_id is None else (tokenizer.eod_id,)
        self.sampling = SamplingConfig(n=cfg.rl.n, max_new_tokens=cfg.rl.max_new_tokens,
                                       temperature=cfg.rl.temperature, stop_token_ids=stops,
                                       kv_budget_mb=cfg.rl.rollout_kv_mb)  # fmt: skip
        self.pad_multiple = 8 * dims.tp
        self.share_prompts = False  # a prompt once per group of samples (`grpo.shared_prompts`)
        # old log-probs: the output layer on the response positions alone where it can
        self._recompute_responses_only = supervised_positions_layout(parts.model, dims)

    def __call__(self, records: list[dict[str, Any]]) -> StepResult:
        if not self.off_policy:
            rollout = self._sample(records)
        else:
            self.async_rollouts = self.async_rollouts or self._async_rollouts(self.rl.async_rollout)
            rollout = self.async_rollouts.next(records, self.state.step)
        batch, rewards, lengths = rollout.batch, rollout.rewards, rollout.lengths
        advantages = adv_fns.token_advantages(self.rl.advantage, rewards, batch.group, lengths,
                                        eps=self.rl.std_eps)  # fmt: skip
        # bounded staleness: groups drawn more than max_staleness versions ago are dropped
        keep = [i for i in range(len(rewards)) if rollout.fresh is None or rollout.fresh[i]]
        if self.rl.dynamic_sampling and not all(rollout.flat):
            keep = [i for i in keep if not rollout.flat[batch.group[i]]]
        micro, mismatch = self._micro_batches(batch, {"advantages": advantages}, keep)
        result = self.updates(batch, micro, keep, lambda mb, last: self.train(mb, schedule=last))
        result.metrics.update(self._rollout_metrics(rollout, len(keep), mismatch))
        return result

    @property
    def state(self):
        return self.train.state

    def evaluate(self, steps) -> float:
        return self.train.evaluate(steps)

    def _async_rollouts(self, mode: str):
        """The `async_rollout.py` scheduler of `mode` (one_step or bounded)."""
        sample, steps = partial(self._sample, sync=False), self.cfg.train.steps
        if mode == "one_step":
            return OneStepRollouts(self.rollout, sample, self.source, steps)
        return BoundedRollouts(self.rollout, sample, self.source, steps, self.rl.max_staleness)

    def settle(self) -> None:
        """Drop the rollouts sampling in the background (waiting for them): before the
        rollout module is used for anything else, e.g. an evaluation."""
        if self.async_rollouts is not None:
            self.async_rollouts.settle()

    @property
    def num_updates(self) -> int:
        return self.rl.epochs * self.rl.mini_batches

    def updates(self, batch: RolloutBatch, micro: list, keep: list[int], update) -> StepResult:
        """`update(micro_batches, last)` once on the step's micro-batches, or rl.epochs
        passes of rl.mini_batches updates: every per-token value of `micro` (advantages,
        old and reference log-probs, PPO's old values and returns) is fixed per sample
        first, each pass shuffles this rank's samples (seeded by step, rank and pass) and
        repacks each mini-batch into `accum` micro-batches. The result: the mean loss and
        grad norm of the updates, their summed units and tokens, each metric's mean, and
        with several updates `loss/epoch_k`, `kl/epoch_k`, `clip_fraction/epoch_k` and
        `ratio/epoch_k` (k from 1)."""
        if self.num_updates == 1:
            return update(micro, True)
        fixed = _per_sample(micro, self._rows(batch, keep), batch,
                            sampler=self.rl.rollout_correction_cap is not None)  # fmt: skip
        count = self._min_over_ranks(len(keep))  # the same number of updates on every rank
        parts = max(1, min(self.rl.mini_batches, count))
        results, epochs = [], []
        for epoch in range(self.rl.epochs):
            gen = torch.Generator().manual_seed(
                sampling_seed(self.cfg.train.seed, self.state.step, self.dims.rank("dp")) + epoch
            )
            order = [keep[i] for i in torch.randperm(len(keep), generator=gen).tolist()]
            size = math.ceil(len(order) / parts)
            for m in range(parts):
                mb = self._pack(batch, fixed, order[m * size : (m + 1) * size])
                last = epoch == self.rl.epochs - 1 and m == parts - 1
                results.append(update(mb, last))
                epochs.append(epoch)
        return combine_results(results, epochs)

    def _min_over_ranks(self, value: int) -> int:
        mesh = self.dims.mesh("dp")
        if mesh is None:
            return value
        tensor = torch.tensor(value, dtype=torch.int64, device=mesh.device_type)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=mesh.get_group())
        return int(tensor.item())

    def _rows(self, batch: RolloutBatch, keep: list[int]) -> list[list[int]]:
        """`keep` in `accum` parts (some may be empty) of about equal token counts (prompt
        + response): the longest sample first, each onto the part with the fewest tokens so
        far, then each part in sample order. By tokens, not by sample count, so that a few
        long responses do not make one micro-batch (and its activations) far larger than
        the rest; the step's loss does not depend on the split (it is normalised per step)."""
        parts: list[list[int]] = [[] for _ in range(self.accum)]
        loads = [0] * self.accum
        groups = [[i] for i in sorted(keep)]
        if self.share_prompts:  # a prompt's samples stay together, so they share it
            groups = []
            for i in sorted(keep):
                if groups and list(batch.prompt_ids[groups[-1][0]]) == list(batch.prompt_ids[i]):
                    groups[-1].append(i)
                else:
                    groups.append([i])
        size = [len(batch.prompt_ids[g[0]]) * (1 if self.share_prompts else len(g))
                + sum(len(batch.response_ids[i]) for i in g) for g in groups]  # fmt: skip
        budget = self.cfg.train.micro_batch_tokens
        if budget is not None:  # as many as the budget needs, the most any rank needs (FSDP)
            plan = plan_micro_batches(size, 1, budget)[0]
            equalise(plan, -self._min_over_ranks(-len(plan)))
            return [sorted(i for k in mb for i in groups[k]) for mb in plan]
        for k in sorted(range(len(groups)), key=lambda k: -size[k]):
            lightest = min(range(self.accum), key=loads.__getitem__)
            parts[lightest] += groups[k]
            loads[lightest] += size[k]
        return [sorted(part) for part in parts]

    def _pack(self, batch: RolloutBatch, per_token: dict[str, Any], keep: list[int]) -> list:
        """`accum` packed micro-batches of the samples `keep` with `per_token` values (per
        sample, a value per response token)."""
        return [
            pack_samples(
                [batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows],
                {}, {k: [v[i] for i in rows] for k, v in per_token.items()},
                agg=self.rl.aggregation(), max_new_tokens=self.rl.max_new_tokens,
                pad_multiple=self.pad_multiple,
                masks=None if batch.response_mask is None else [batch.response_mask[i] for i in rows],
                share_prompts=self.share_prompts,
            )
            for rows in self._rows(batch, keep)
        ]  # fmt: skip

    def _sample(self, records: list[dict[str, Any]], *, step: int | None = None,
                sync: bool = True) -> _Rollout:  # fmt: skip
        """Sync (unless `sync` is false: the caller did), sample this rank's completions of
        `step` (default: the current one), score them (with the overlong penalty)."""
        sync_s = self.rollout.sync_weights() if sync else 0.0
        step = self.state.step if step is None else step
        seed = sampling_seed(self.cfg.train.seed, step, self.dims.rank("dp"))
        prompts = [r["prompt_ids"] for r in records]
        if self.env is not None:
            episodes = run_episodes(self.rollout, self.env, records, prompts, self.sampling,
                                    template=self.template, tokenizer=self.tokenizer, seed=seed,
                                    max_turns=self.rl.env_max_turns, max_tokens=self.rl.env_max_tokens)  # fmt: skip
            batch, rewards = episodes.batch, episodes.rewards
            reward_metrics = {"reward/failures": 0.0, **episodes.metrics}
        else:
            batch = self.rollout.generate(prompts, self.sampling, seed=seed)
            rewards, reward_metrics = self._rewards(records, batch)
        lengths = [len(r) for r in batch.response_ids]
        if self.rl.overlong_buffer:
            penalty = adv_fns.overlong_penalty(lengths, self.rl.max_new_tokens, self.rl.overlong_buffer,
                                       self.rl.overlong_penalty)  # fmt: skip
            rewards = [r + p for r, p in zip(rewards, penalty, strict=True)]
            reward_metrics["reward/overlong"] = sum(penalty) / len(penalty)
        flat = _flat_groups(rewards, batch.group)
        return _Rollout(batch, rewards, reward_metrics, lengths, flat, sync_s)

    def _rollout_metrics(self, rollout: _Rollout, kept: int, mismatch) -> dict[str, float]:
        """The rollout's statistics over every data-parallel rank."""
        rewards, lengths, batch = rollout.rewards, rollout.lengths, rollout.batch
        reward_metrics = dict(rollout.reward_metrics)
        # judges', code tests' failures, the staleness histogram
        counts = tuple(k for k in reward_metrics if k.startswith((FAILURE_COUNTS, *STALENESS_COUNTS)))
        stats = _Stats(self.dims, totals=ENV_COUNTS + counts)
        stats.add_sums(
            reward=sum(rewards), reward_sq=sum(x * x for x in rewards), samples=len(rewards),
            zero_var=sum(rollout.flat), groups=len(rollout.flat), kept=kept, length=sum(lengths),
            stopped=sum(batch.stopped), diff_sum=mismatch.sum, diff_count=mismatch.count,
            diff_kl=mismatch.kl_sum,
            rollout_s=batch.seconds, failures=reward_metrics.pop("reward/failures"),
            sync_bytes=getattr(self.rollout, "last_bytes", 0),
        )  # fmt: skip
        if mismatch.cap is not None:  # TIS: the share of tokens whose weight was capped
            stats.add_sums(is_capped=mismatch.capped)
        stats.add_max(diff_max=mismatch.max, sync_s=rollout.sync_s)
        return stats.metrics(reward_metrics, warn_flat=adv_fns.ESTIMATORS[self.rl.advantage].group)

    def _rewards(self, records, batch: RolloutBatch):
        stops = set(self.sampling.stop_token_ids)
        texts = [
            self.tokenizer.decode([t for t in r if t not in stops]) for r in batch.response_ids
        ]
        prompts = [records[g]["prompt"] for g in batch.group]
        names = [k for k in records[0] if k not in ("prompt", "prompt_ids")]
        columns = {k: [records[g].get(k) for g in batch.group] for k in names}
        return self.rewards(prompts, texts, columns)

    def _micro_batches(self, batch: RolloutBatch, per_token: dict[str, list], keep: list[int]):
        """`accum` packed micro-batches (always that many: FSDP's collectives pair up
        across ranks) of the samples `keep`, with `per_token` values (one list per sample,
        a value per response token), the sampler's log-probs, the reference's, and the
        old ones when rl.recompute_old_logps or several updates; and the sampler/trainer
        `Mismatch`, measured here by the recompute, else by the training forward (the
        objective fills it)."""
        cap = self.rl.rollout_correction_cap
        mismatch = Mismatch(cap)
        # off-policy samples: the ratio is against the sampling policy's own log-probs
        recompute = (self.rl.recompute_old_logps or self.num_updates > 1) and not self.off_policy
        sampler = {"sampler_logps": batch.sampler_logprobs}
        out = self._pack(batch, {**per_token, **sampler}, keep)
        for b in out if self.off_policy else ():
            b["old_logps"] = b["sampler_logps"].clone()
        # the reference's log-probs are asked for first: a Ray reference works meanwhile
        pending = None if self.reference is None else self.reference.submit(out, self.rl.temperature)
        for b in out if recompute else ():
            b["old_logps"] = recompute_logps(self.parts.model, b, self.rl.temperature,
                                             supervised_only=self._recompute_responses_only)  # fmt: skip
            # the loss keeps the sampler's log-probs only for its rollout correction
            sampler_logps = b["sampler_logps"] if cap is not None else b.pop("sampler_logps")
            mismatch.add(b["old_logps"], sampler_logps, b["labels"] != -100)
        for b, ref in zip(out, pending() if pending else [None] * len(out), strict=True):
            if ref is not None:
                b["ref_logps"] = ref
        self.objective.watch(None if recompute else mismatch)
        return out, mismatch


def _per_sample(micro: list, rows: list[list[int]], batch: RolloutBatch, *,
                sampler: bool = False) -> dict[str, dict[int, list]]:  # fmt: skip
    """Every per-token float value of the packed `micro` (rows[k]: micro[k]'s samples),
    per sample: {key: {sample: one value per response token}} (0 on an environment's
    tokens, which carry no label); the sampler's log-probs only if `sampler` (the loss's
    rollout correction reads them)."""
    skip = {"input_ids", "labels", "position_ids", "cu_seqlens", "weights", "metric_weights",
            "unit", *SHARED_KEYS, *(() if sampler else ("sampler_logps",))}  # fmt: skip
    masks = batch.response_mask
    out: dict[str, dict[int, list]] = {}
    for b, samples in zip(micro, rows, strict=True):
        mask = (b["labels"] != IGNORE_INDEX).flatten()
        lengths = [len(batch.response_ids[i]) if masks is None else sum(masks[i]) for i in samples]
        for key, value in b.items():
            if key in skip:
                continue
            pieces = value.flatten()[mask].split(lengths)
            out.setdefault(key, {}).update(
                {i: _unmasked(p.tolist(), None if masks is None else masks[i])
                 for i, p in zip(samples, pieces, strict=True)}  # fmt: skip
            )
    return out


def _unmasked(values: list[float], mask: list[int] | None) -> list[float]:
    """`values` of the policy's tokens spread over every response token (0 elsewhere)."""
    if mask is None:
        return values
    it = iter(values)
    return [next(it) if m else 0.0 for m in mask]


def combine_results(results: list[StepResult], epochs: list[int]) -> StepResult:
    """Several updates' results as one step's (see `GRPOStep.updates`)."""
    n = len(results)
    metrics = {k: sum(r.metrics[k] for r in results) / n for k in results[0].metrics}
    for epoch in sorted(set(epochs)):
        mine = [r for r, e in zip(results, epochs, strict=True) if e == epoch]
        metrics[f"loss/epoch_{epoch + 1}"] = sum(r.loss for r in mine) / len(mine)
        for key in ("kl", "clip_fraction", "ratio"):
            if key in mine[0].metrics:
                metrics[f"{key}/epoch_{epoch + 1}"] = sum(r.metrics[key] for r in mine) / len(mine)
    return StepResult(
        sum(r.loss for r in results) / n, sum(r.grad_norm for r in results) / n,
        sum(r.num_units for r in results), sum(r.num_tokens for r in results), metrics,
    )


@dataclass
class _Rollout:
    """One step's samples and what was measured of them."""

    batch: RolloutBatch
    rewards: list[float]
    """Per sample, weighted sum of the reward functions (and the overlong penalty)."""
    reward_metrics: dict[str, float]
    lengths: list[int]
    flat: list[bool]
    """Per group: every reward equal."""
    sync_s: float
    fresh: list[bool] | None = None
    """Per sample: drawn within grpo.max_staleness versions (None: not asked)."""


def _flat_groups(rewards: list[float], group: list[int]) -> list[bool]:
    """Per group: every reward equal (zero variance: no policy gradient)."""
    seen: dict[int, set] = {}
    for r, g in zip(rewards, group, strict=True):
        seen.setdefault(g, set()).add(r)
    return [len(seen[g]) == 1 for g in sorted(seen)]


class _Stats:
    """Rollout statistics summed (or maxed) over the data-parallel ranks."""

    def __init__(self, dims, totals: tuple[str, ...] = ()):
        self.mesh = dims.mesh("dp")
        self.totals = totals
        """Keys of the reward means that are counts: summed over the ranks, not averaged."""
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add_sums(self, **values):
        self.sums.update(values)

    def add_max(self, **values):
        self.maxes.update(values)

    def _reduce(self, values: dict, op) -> dict:
        tensor = torch.tensor(list(values.values()), dtype=torch.float64)
        if self.mesh is not None:
            group = self.mesh.get_group()
            tensor = tensor.to(self.mesh.device_type)
            dist.all_reduce(tensor, op=op, group=group)
        return dict(zip(values, tensor.tolist(), strict=True))

    def metrics(self, reward_means: dict[str, float], *, warn_flat: bool = True) -> dict[str, float]:
        ranks = 1 if self.mesh is None else self.mesh.size()
        s = self._reduce({**self.sums, **reward_means}, dist.ReduceOp.SUM)
        m = self._reduce(self.maxes, dist.ReduceOp.MAX)
        n = s["samples"]
        mean = s["reward"] / n
        out = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(s["reward_sq"] / n - mean * mean, 0.0)),
            **{k: s[k] / (1 if k in self.totals else ranks) for k in reward_means},
            "reward/failures": s["failures"],
            "groups/zero_variance_fraction": s["zero_var"] / s["groups"],
            "groups/kept_fraction": s["kept"] / n,
            "response/length_mean": s["length"] / n,
            "response/stopped_fraction": s["stopped"] / n,
            "rollout/logprob_diff_mean": s["diff_sum"] / max(s["diff_count"], 1),
            "rollout/logprob_diff_max": m["diff_max"],
            "rollout/logprob_kl_k3": s["diff_kl"] / max(s["diff_count"], 1),
            "rollout/tokens_per_s": s["length"] / max(s["rollout_s"] / ranks, 1e-9),
            "rollout/weight_sync_s": m["sync_s"],
            "rollout/weight_sync_bytes": s["sync_bytes"],
        }
        if "is_capped" in s:
            out["rollout/is_capped_fraction"] = s["is_capped"] / max(s["diff_count"], 1)
        if warn_flat and s["zero_var"] == s["groups"]:
            logger.warning(
                "every group's rewards are equal (%d groups): the policy gradient of this "
                "step is 0 (GRPO's 'loss is 0' trap: rewards too easy, too hard or constant)",
                int(s["groups"]),
            )
        return out


class GRPOMethod:
    """GRPO as a `Trainer`'s method (what `Trainer(objective=...)` calls `setup` and
    `build_step` on): the roles around the loss: `setup` creates the reference
    (colocated, or an actor of `roles`, a `placement.RayRoles`) when the KL needs one;
    `build_step` returns the rollout step (`step_cls`), which trains `objective`, the loss
    (`GRPOObjective`, from `cfg.rl`), held here rather than inherited: the loss knows
    nothing of tokenizers, rewards, Ray or environments. `ppo.PPOMethod` adds a critic."""

    step_cls: type[GRPOStep] = GRPOStep

    def __init__(self, cfg: GRPOConfig, tokenizer, rewards: Rewards, init_from=None, *, roles=None,
                 env=None, template=None):  # fmt: skip
        self.objective = GRPOObjective.from_section(cfg.rl)
        self.cfg, self.tokenizer, self.rewards = cfg, tokenizer, rewards
        self.init_from, self.roles, self.reference = init_from, roles, None
        self.env, self.template = env, template

    def setup(self, run: RunContext) -> None:
        cfg = self.cfg  # the policy got `init_from` from the trainer (its warm start)
        if cfg.rl.kl_coef and self.roles is not None:
            self.reference = self.roles.reference(run.model_config, seed=cfg.train.seed,
                                                  seq_len=cfg.data.seq_len, precision=cfg.train.precision,
                                                  hf_path=cfg.model.hf_path, init_from=self.init_from)  # fmt: skip
        elif cfg.rl.kl_coef and cfg.lora.enabled:  # the policy itself, its adapters off
            self.reference = BaseReference(
                run.policy, supervised_only=supervised_positions_layout(run.policy, run.dims)
            )
        elif cfg.rl.kl_coef:  # the run's model as it starts
            reference = run.starting_policy()
            self.reference = LocalReference(
                reference, supervised_only=supervised_positions_layout(reference, run.dims)
            )

    def _placed_rollout(self, run: RunContext):
        """The rollout on vLLM (`rollout_engine: vllm`: one engine per tp x cp group), on its
        own Ray actor (`placement: ray`, vLLM's engine inside it with vllm), else None (our
        engine on this rank)."""
        g = self.cfg.rl
        if g.rollout_engine == "vllm" and self.roles is None:
            from mindspeed_align.rl.vllm_group import start_vllm_rollout

            return start_vllm_rollout(run, self.cfg)
        if self.roles is None:
            return None
        vllm = None
        if g.rollout_engine == "vllm":
            from mindspeed_align.rl.vllm_rollout import ensure_vllm_python

            vllm = ensure_vllm_python(run.device.type, g.vllm_python, section=g.section)
        return self.roles.rollout(run.policy, seq_len=self.cfg.data.seq_len,
                                  precision=self.cfg.train.precision, lora=self.cfg.lora,
                                  vllm_python=vllm, seed=self.cfg.train.seed)  # fmt: skip

    def step_extras(self) -> dict[str, Any]:
        """More keyword arguments of `step_cls` (PPO's critic)."""
        return {}

    def build_step(self, run: RunContext) -> GRPOStep:
        g = self.cfg.rl
        step = self.step_cls(run.parts, self.objective, run.dims, cfg=self.cfg, tokenizer=self.tokenizer,
                             rewards=self.rewards, reference=self.reference, accum=run.accum,
                             env=self.env, template=self.template, source=run.data,
                             rollout=self._placed_rollout(run),
                             **run.step_options, **self.step_extras())  # fmt: skip
        step.share_prompts = shares_prompts(g.shared_prompts, run, g.section)
        if g.rollout_kv_mb:  # refused before anything is written, for the longest prompt allowed
            try:
                step.rollout.prompts_within_budget(
                    self.cfg.data.seq_len - g.max_new_tokens, step.sampling
                )
            except ConfigError as err:
                raise ConfigError(f"{g.section}.rollout_kv_mb: {err}") from None
        return step
