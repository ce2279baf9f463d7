"""Rollouts that sample while the policy trains (`grpo.async_rollout`).

A scheduler hands `GRPOStep` each step's rollout and keeps the next ones sampling in one
background thread, through a whole copy of the policy (`LocalRollout(copy=True)`); the
step's ratio is then against the sampler's own log-probs (see `GRPOStep._micro_batches`).
A policy *version* is the number of optimizer steps behind it: step s trains version s, and
a token drawn by version u is s - u versions stale when step s trains on it.

- `OneStepRollouts` (one_step): as step s starts, the weights are synced and the rollout of
  step s+1 starts; step s trains on the rollout started as step s-1 began (staleness 1).
- `BoundedRollouts` (bounded, with max_staleness K): up to K+1 rollouts (of steps s..s+K)
  are queued or sampling at once. The weights are synced as every step starts, also under
  a rollout still sampling: its later tokens are drawn by the new weights (a partial
  rollout: AReaL's interrupted generation, PipelineRL's in-flight update; the KV cache of
  the earlier tokens stays as the old weights wrote it). Every token is tagged with the
  version that drew it; a sample is as stale as its oldest token, and a group with a
  sample more than K versions stale is dropped. The rollout of step j is only queued once
  version j - K exists (AReaL's gate), so nothing it draws can be more than K versions
  stale when step j trains: the drop guards that bound, it does not shape the batch.

Either way the rollouts queued at a checkpoint are not saved: a resumed run samples its
first step synchronously and queues the next ones again (with the same seeds, but other
weights under them than an uninterrupted run had).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["STALENESS_COUNTS", "BoundedRollouts", "OneStepRollouts", "staleness"]

STALENESS_COUNTS = ("rollout/staleness/", "rollout/dropped", "rollout/partial")
"""Prefixes of the bounded scheduler's metrics that are sample counts (summed over ranks):
`rollout/staleness/<k>` (samples k versions stale, k = 0..K), `rollout/dropped` (samples
more than K stale), `rollout/partial` (samples whose tokens two versions drew)."""

Sample = Callable[..., Any]
"""`sample(records, step=j)`: the rollout (`grpo._Rollout`) of step j's records, drawn with
step j's seed on the weights the rollout module holds (no sync)."""


class OneStepRollouts:
    """one_step: step s trains on samples of the policy one update old (see the module).

    Args:
        rollout: the rollout role (`roles.Rollout`) whose weights are synced.
        sample: draws a step's rollout (`Sample`).
        source: the prompts (`peek()`: the next step's), or None (nothing is prefetched).
        num_steps: the run's steps (no rollout is started past the last).
    """

    def __init__(self, rollout, sample: Sample, source, num_steps: int):
        self.rollout, self.sample, self.source, self.num_steps = rollout, sample, source, num_steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self._pending: tuple[list, Future, float] | None = None
        """(the prompts, the rollout running on them, the seconds its weight sync took)"""

    def next(self, records: list[dict[str, Any]], step: int):
        """Step `step`'s rollout (sampled while the step before trained, by the policy as it
        was then; sampled now when there is none, as on the first step or after a resume),
        and the next step's started in the background with the policy as it is now, before
        this step changes it."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == [r["prompt_ids"] for r in records]:
            rollout, lag = pending[1].result(), 1.0
            rollout.sync_s = pending[2]
        else:
            if pending is not None:  # other prompts than expected: sample these now
                pending[1].result()
            sync_s = self.rollout.sync_weights()
            rollout, lag = self.sample(records, step=step), 0.0
            rollout.sync_s = sync_s
        rollout.reward_metrics["rollout/staleness"] = lag
        if self.source is not None and step + 1 < self.num_steps:
            upcoming = self.source.peek()
            sync_s = self.rollout.sync_weights()
            future = self._pool.submit(self.sample, upcoming, step=step + 1)
            self._pending = ([r["prompt_ids"] for r in upcoming], future, sync_s)
        return rollout

    def settle(self) -> None:
        """Wait for a rollout running in the background and drop it (before the rollout
        module is used for anything else, e.g. an evaluation)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].result()


class BoundedRollouts:
    """bounded: rollouts of steps s..s+K in flight, partial rollouts, samples at most K
    versions stale (see the module).

    Args:
        rollout: the rollout role; when its batches carry `token_syncs` it must count its
            syncs in `syncs` (`LocalRollout` does), else a sample's tokens are all tagged
            with the version synced last before its rollout began (exact where a sync
            waits for a running `generate`, conservative otherwise).
        sample: draws a step's rollout (`Sample`).
        source: the prompts (`peek(ahead)`: the prompts `ahead` steps after the next).
        num_steps: the run's steps (no rollout is queued past the last).
        max_staleness: K >= 1.
    """

    def __init__(self, rollout, sample: Sample, source, num_steps: int, max_staleness: int):
        assert max_staleness >= 1, max_staleness
        self.rollout, self.sample, self.source, self.num_steps = rollout, sample, source, num_steps
        self.max_staleness = max_staleness
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self._queued: dict[int, tuple[list, Future]] = {}
        """step -> (its prompts, its rollout with the version synced as it began)"""
        self._version = 0
        """The version the rollout module holds (the last one synced)."""
        self._versions: dict[int, int] = {}
        """The rollout's sync count after each of our syncs -> the version it brought (a
        sampler whose count stalls, its weights not reaching it, keeps tagging the old one)."""

    def next(self, records: list[dict[str, Any]], step: int):
        """Sync version `step`, queue the rollouts of steps up to step + K, return step's
        (waiting for it) with its samples tagged and the drop decided (`fresh`)."""
        queued = self._queued.get(step)
        if queued is not None and queued[0] != [r["prompt_ids"] for r in records]:
            self.settle()  # other prompts than planned: drop everything queued
        sync_s = self._sync(step)
        if step not in self._queued:  # the first step, after a resume or a settle
            self._submit(step, records)
        last = min(step + self.max_staleness, self.num_steps - 1)
        for later in range(step + 1, last + 1) if self.source is not None else ():
            if later not in self._queued:
                self._submit(later, self.source.peek(ahead=later - step - 1))
        rollout, began = self._queued.pop(step)[1].result()
        rollout.sync_s = sync_s
        self._judge(rollout, step, began)
        return rollout

    def _sync(self, version: int) -> float:
        seconds = self.rollout.sync_weights()
        self._version = version
        if hasattr(self.rollout, "syncs"):  # a count that did not move keeps its first version
            self._versions.setdefault(self.rollout.syncs, version)
        return seconds

    def _submit(self, step: int, records: list[dict[str, Any]]) -> None:
        def job():
            began = self._version  # read as the rollout starts sampling
            return self.sample(records, step=step), began

        self._queued[step] = ([r["prompt_ids"] for r in records], self._pool.submit(job))

    def _judge(self, rollout, step: int, began: int) -> None:
        """Tag `rollout`'s samples with their staleness at `step`, set `rollout.fresh` (per
        sample: its group is at most K stale) and the metrics."""
        batch = rollout.batch
        if batch.token_syncs is None:
            oldest = [began] * len(batch.response_ids)
            partial = 0
        else:
            oldest = [
                min((self._versions[c] for c in syncs), default=step) for syncs in batch.token_syncs
            ]
            partial = sum(len(set(syncs)) > 1 for syncs in batch.token_syncs)
        lag = staleness(step, oldest, batch.group)
        stale_groups = {g for g, s in zip(batch.group, lag, strict=True) if s > self.max_staleness}
        rollout.fresh = [g not in stale_groups for g in batch.group]
        metrics = rollout.reward_metrics
        metrics["rollout/staleness_mean"] = sum(lag) / max(len(lag), 1)
        for k in range(self.max_staleness + 1):
            metrics[f"rollout/staleness/{k}"] = float(lag.count(k))
        metrics["rollout/dropped"] = float(len(lag) - sum(rollout.fresh))
        metrics["rollout/partial"] = float(partial)

    def settle(self) -> None:
        """Drop every queued rollout (cancelled where not started, waited for where
        sampling): before the rollout module is used for anything else."""
        for _, future in self._queued.values():
            future.cancel()
        for _, future in self._queued.values():
            if not future.cancelled():
                future.result()
        self._queued.clear()


def staleness(step: int, oldest: list[int], group: list[int]) -> list[int]:
    """Per sample, the versions between its group's oldest token and `step` (a group is as
    stale as its stalest sample: it is kept or dropped whole, so its advantages stand)."""
    worst: dict[int, int] = {}
    for g, version in zip(group, oldest, strict=True):
        worst[g] = max(worst.get(g, 0), step - version)
    return [worst[g] for g in group]
