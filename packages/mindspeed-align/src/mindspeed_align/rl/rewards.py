"""Rewards: Python callables scoring completions, weighted, run in worker processes.

A reward function follows TRL's signature::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where `columns` are the prompt records' other fields (e.g. `answer`), one value per
completion. `Rewards` loads them from "module:function" specs, calls each on every
completion in a pool of worker processes with a per-completion timeout, and sums them
with their weights. A function that raises or runs past the timeout gives that
completion 0 for that function; the failures are counted in the metrics and the run
goes on (a hung worker is replaced).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from mindspeed_core.errors import ConfigError
from mindspeed_core.lifeline import pool_initializer, spawn_context

__all__ = ["RewardFn", "Rewards", "exact_match", "final_number", "load_reward", "math_verify",
           "required_columns"]

logger = logging.getLogger("mindspeed.rl")

RewardFn = Callable[..., list[float]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the completion, stripped of surrounding space and a trailing period,
    equals str(answer), else 0.0."""
    return [
        float(c.strip().rstrip(".").strip() == str(a).strip())
        for c, a in zip(completions, answer, strict=True)
    ]


def final_number(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the first number in the completion equals the number `answer`
    (the answer follows the prompt right away in the demo task; GSM8K-style tasks
    want the last one: `final_number_last`)."""
    return [
        _number_score(_NUMBER.findall(c)[:1], a) for c, a in zip(completions, answer, strict=True)
    ]


def final_number_last(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the last number in the completion equals the number `answer`."""
    return [
        _number_score(_NUMBER.findall(c)[-1:], a) for c, a in zip(completions, answer, strict=True)
    ]


def math_verify(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the completion's final answer is mathematically equal to `answer` (LaTeX,
    fractions, sets, intervals...), judged by Hugging Face's math-verify package
    (`pip install 'mindspeed-align[math]'`), as TRL's and verl's math rewards do."""
    from math_verify import parse, verify

    return [
        float(verify(parse(str(a)), parse(c))) for c, a in zip(completions, answer, strict=True)
    ]


def _number_score(found: list[str], answer) -> float:
    if not found:
        return 0.0
    try:
        return float(math.isclose(float(found[0]), float(answer), abs_tol=1e-9))
    except ValueError:
        return 0.0


def load_reward(spec: str) -> RewardFn:
    """The function named by "module:function" (or a built-in's bare name)."""
    module, sep, name = spec.partition(":")
    if not sep:
        module, name = __name__, spec
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"grpo.rewards: cannot load {spec!r} ({err})") from None
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {spec!r} is not callable")
    if fn is math_verify and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("grpo.rewards: math_verify needs the math-verify package "
                          "(pip install 'mindspeed-align[math]')")  # fmt: skip
    return fn


def required_columns(specs: Sequence[str]) -> dict[str, str]:
    """{column: the first reward spec that needs it}: the parameters a reward function names
    after (prompts, completions) without a default, which the prompt records must hold."""
    needed: dict[str, str] = {}
    for spec in specs:
        params = list(inspect.signature(load_reward(spec)).parameters.values())[2:]
        for param in params:
            plain = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if plain and param.default is param.empty:
                needed.setdefault(param.name, spec)
    return needed


def _score_one(spec: str, prompt: str, completion: str, columns: dict) -> float:
    """Runs in a worker: one function on one completion."""
    values = load_reward(spec)([prompt], [completion], **{k: [v] for k, v in columns.items()})
    return _checked(values, 1)[0]


class BadScores(ValueError):
    """A reward function returned the wrong number of scores, or a score that is no finite
    number: each such completion is a counted failure, scored 0."""


def _checked(values, expected: int) -> list[float]:
    """`values` as floats, after checking there are `expected` finite ones."""
    try:
        scores = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise BadScores(f"returned something that is not a list of numbers ({err})") from None
    if len(scores) != expected:
        raise BadScores(f"returned {len(scores)} scores for {expected} completions")
    bad = [s for s in scores if not math.isfinite(s)]
    if bad:
        raise BadScores(f"returned {bad[0]}")
    return scores


def _warn(spec: str, failures: int, total: int, first: BaseException) -> None:
    reason = str(first) if isinstance(first, (BadScores, TimeoutError)) else (
        f"raised {type(first).__name__}: {first}"
    )
    logger.warning("reward %s: %d of %d completions failed (first: %s); scored 0", spec,
                   failures, total, reason)  # fmt: skip


class Rewards:
    """Weighted rule rewards.

    Args:
        specs: "module:function" per reward function (bare names: the built-ins here).
        weights: one per function (default 1.0 each).
        workers: worker processes (0: call in this process, no timeout).
        timeout_s: seconds a worker may take on one completion.
        model: a `reward_model.RewardModel` scoring in this process (None: rules only).
        model_weight: its weight in the sum.
    """

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), *, workers: int = 2,
                 timeout_s: float = 10.0, model=None, model_weight: float = 1.0):  # fmt: skip
        if not specs and model is None:
            raise ConfigError("grpo.rewards is empty: name at least one reward function "
                              "(or a grpo.reward_model)")  # fmt: skip
        if weights and len(weights) != len(specs):
            raise ConfigError(
                f"grpo.reward_weights has {len(weights)} values for {len(specs)} rewards"
            )
        self.fns = {spec: load_reward(spec) for spec in specs}  # fail early, in this process
        self.specs, self.weights = list(specs), list(weights) or [1.0] * len(specs)
        self.workers, self.timeout_s = workers, timeout_s
        self.model, self.model_weight = model, model_weight
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(total reward per completion, metrics: each function's mean, failures)."""
        total = [0.0] * len(completions)
        metrics: dict[str, float] = {"reward/failures": 0.0}
        for spec, weight in zip(self.specs, self.weights, strict=True):
            scores, failures = self._score(spec, prompts, completions, columns)
            total = [t + weight * s for t, s in zip(total, scores, strict=True)]
            metrics[f"reward/{spec.rpartition(':')[2]}"] = sum(scores) / max(len(scores), 1)
            metrics["reward/failures"] += failures
        if self.model is not None:  # a `reward_model.RewardModel`, in this process
            scores = self.model(prompts, completions)
            total = [t + self.model_weight * s for t, s in zip(total, scores, strict=True)]
            metrics["reward/model"] = sum(scores) / max(len(scores), 1)
        return total, metrics

    def _score(self, spec, prompts, completions, columns) -> tuple[list[float], int]:
        """Each completion's score and the number of failures (raised, hung, wrong count,
        not a finite number: scored 0); one warning per call that had any."""
        if self.workers == 0:
            try:
                fn = self.fns[spec]
                scores = _checked(fn(list(prompts), list(completions), **columns), len(completions))
                return scores, 0
            except Exception as err:  # a user's function: counted, the run goes on
                _warn(spec, len(completions), len(completions), err)
                return [0.0] * len(completions), len(completions)
        pool = self._get_pool()
        futures = [
            pool.submit(_score_one, spec, p, c, {k: v[i] for k, v in columns.items()})
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        scores, failures, first, hung = [], 0, None, False
        for future in futures:
            try:
                scores.append(future.result(timeout=self.timeout_s))
                continue
            except FutureTimeout:
                hung = True
                err = TimeoutError(f"ran past {self.timeout_s:.1f} s")
            except Exception as raised:
                err = raised
            scores.append(0.0)
            failures += 1
            first = first or err
        if failures:
            _warn(spec, failures, len(completions), first)
        if hung:
            self.close()  # a hung worker is killed; fresh ones start on the next call
        return scores, failures

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = spawn_context()
            self._pool = ProcessPoolExecutor(  # workers die with this process, even SIGKILLed
                self.workers, mp_context=context, initializer=pool_initializer,
                initargs=(os.getpid(),),
            )  # fmt: skip
        return self._pool

    def close(self) -> None:
        """Stops the workers (a hung one is killed)."""
        if self._pool is None:
            return
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
