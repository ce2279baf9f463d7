"""Rewards: Python callables, LLM judges and code tests scoring completions, weighted.

A reward function follows TRL's signature::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where `columns` are the prompt records' other fields (e.g. `answer`), one value per
completion. `Rewards` loads them from "module:function" specs, calls each on every
completion in a pool of worker processes with a per-completion timeout, and sums them
with their weights. A function that raises or runs past the timeout gives that
completion 0 for that function; the failures are counted in the metrics and the run
goes on (a hung worker is replaced).

Beside the functions, `grpo.rewards` takes mappings scored in threads of this process, each
with its own timeouts: `{judge: URL, model: NAME, ...}`, an OpenAI-compatible endpoint
grading each completion (`judge.py`), and `{code: FIELD, ...}`, the completion's code run
against the record's tests in the sandbox (`code_reward.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from mindspeed_align.rl.code_reward import CodeReward, CodeTests
from mindspeed_align.rl.judge import Judge, JudgeReward
from mindspeed_core.config import from_dict
from mindspeed_core.errors import ConfigError
from mindspeed_core.lifeline import pool_initializer, spawn_context

__all__ = ["FAILURE_COUNTS", "RewardFn", "Rewards", "exact_match", "final_number", "load_reward",
           "math_verify", "required_columns", "reward_entries", "reward_weights"]

logger = logging.getLogger("mindspeed.rl")

RewardFn = Callable[..., list[float]]
RewardEntry = str | JudgeReward | CodeReward
"""One `grpo.rewards` entry, parsed (`reward_entries`)."""
FAILURE_COUNTS = "reward/failures/"
"""Metrics under this prefix are counts (summed over the data-parallel ranks, not averaged)."""
_KINDS = {"judge": JudgeReward, "code": CodeReward}

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


def reward_entries(specs: Sequence, section: str = "grpo") -> list[RewardEntry]:
    """Each entry of `{section}.rewards`: a "module:function" string as it is, a mapping
    `{judge: URL, ...}` as a `JudgeReward`, `{code: FIELD, ...}` as a `CodeReward`, checked.

    Raises:
        ConfigError: naming the entry (`grpo.rewards[1]`) and its bad key or value.
    """
    entries: list[RewardEntry] = []
    for i, spec in enumerate(specs):
        where = f"{section}.rewards[{i}]"
        if isinstance(spec, (str, JudgeReward, CodeReward)):
            entry = spec
        elif isinstance(spec, Mapping):
            kinds = [kind for kind in _KINDS if kind in spec]
            if len(kinds) != 1:
                raise ConfigError(f"{where}: a reward mapping names its kind with one of "
                                  f"'judge: URL' (an LLM judge) or 'code: FIELD' (the record's "
                                  f"tests), got keys {sorted(map(str, spec))}")  # fmt: skip
            entry = from_dict(_KINDS[kinds[0]], spec, source=where)
        else:
            raise ConfigError(f"{where}: expected a reward name or a mapping, got {spec!r}")
        if not isinstance(entry, str):
            entry.check(where)
        entries.append(entry)
    return entries


def reward_weights(entries: Sequence[RewardEntry], weights: Sequence[float],
                   section: str = "grpo") -> list[float]:  # fmt: skip
    """Each entry's weight: its own `weight`, else `{section}.reward_weights`' value, else 1.

    Raises:
        ConfigError: the lengths differ, an entry is weighed twice, or two judge/code
            entries share a metric name.
    """
    if weights and len(weights) != len(entries):
        raise ConfigError(f"{section}.reward_weights has {len(weights)} values for "
                          f"{len(entries)} rewards")  # fmt: skip
    out, names = [], {}
    for i, entry in enumerate(entries):
        given = weights[i] if weights else None
        own = None if isinstance(entry, str) else entry.weight
        if own is not None and given is not None:
            raise ConfigError(f"{section}.rewards[{i}].weight and {section}.reward_weights[{i}] "
                              "both weigh it: keep one")  # fmt: skip
        out.append(next((w for w in (own, given) if w is not None), 1.0))
        name = _name(entry)
        if not isinstance(entry, str) and name in names:
            raise ConfigError(f"{section}.rewards[{i}].name={name!r} is taken by "
                              f"{section}.rewards[{names[name]}]: give each its own name")  # fmt: skip
        names.setdefault(name, i)
    return out


def required_columns(specs: Sequence, section: str = "grpo") -> dict[str, str]:
    """{column: the first reward that needs it}: the parameters a reward function names
    after (prompts, completions) without a default, the judge template's {reference} field
    and the code reward's tests field, which the prompt records must hold."""
    needed: dict[str, str] = {}
    for entry in reward_entries(specs, section):
        if not isinstance(entry, str):
            for column in entry.columns():
                needed.setdefault(column, entry.name)
            continue
        params = list(inspect.signature(load_reward(entry)).parameters.values())[2:]
        for param in params:
            plain = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if plain and param.default is param.empty:
                needed.setdefault(param.name, entry)
    return needed


def _name(entry: RewardEntry) -> str:
    """The entry's name in the metrics (reward/NAME)."""
    return entry.rpartition(":")[2] if isinstance(entry, str) else entry.name


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
    """Weighted rewards: rule functions, LLM judges and code tests, summed with their
    weights; every placement (in the trainer, in a Ray reward actor) scores through this.

    Args:
        specs: `grpo.rewards`' entries: "module:function" (bare names: the built-ins here),
            `{judge: URL, ...}` or `{code: FIELD, ...}` mappings (or their dataclasses).
        weights: one per entry (default: each entry's own weight, else 1.0).
        workers: worker processes for the rule functions (0: call them in this process, no
            timeout); judges and code tests run in threads of this process, with their own
            timeouts.
        timeout_s: seconds a worker may take on one completion.
        model: a `reward_model.RewardModel` scoring in this process (None: no model).
        model_weight: its weight in the sum.
        section: the config section, for messages.
    """

    def __init__(self, specs: Sequence, weights: Sequence[float] = (), *, workers: int = 2,
                 timeout_s: float = 10.0, model=None, model_weight: float = 1.0,
                 section: str = "grpo"):  # fmt: skip
        if not specs and model is None:
            raise ConfigError(f"{section}.rewards is empty: name at least one reward function "
                              f"(or a {section}.reward_model)")  # fmt: skip
        entries = reward_entries(specs, section)
        self.weights = reward_weights(entries, weights, section)
        # fail early, in this process
        self.fns = {e: load_reward(e) for e in entries if isinstance(e, str)}
        self.scorers = [(e, _name(e), _scorer(e, f"{section}.rewards[{i}]"))
                        for i, e in enumerate(entries)]  # fmt: skip
        self.workers, self.timeout_s = workers, timeout_s
        self.model, self.model_weight = model, model_weight
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(total reward per completion, metrics: each reward's mean, reward/failures (the
        completions scored 0 because a reward failed on them), and for judges and code tests
        reward/failures/NAME/CAUSE counts and reward/NAME/OUTCOME fractions)."""
        total = [0.0] * len(completions)
        metrics: dict[str, float] = {"reward/failures": 0.0}
        for (entry, name, scorer), weight in zip(self.scorers, self.weights, strict=True):
            if scorer is None:
                scores, failures = self._score(entry, prompts, completions, columns)
            else:
                scores, causes, fractions = scorer(list(prompts), list(completions), columns)
                failures = sum(causes.values())
                metrics.update({f"reward/failures/{name}/{k}": float(v) for k, v in causes.items()})
                metrics.update({f"reward/{name}/{k}": v for k, v in fractions.items()})
            total = [t + weight * s for t, s in zip(total, scores, strict=True)]
            metrics[f"reward/{name}"] = sum(scores) / max(len(scores), 1)
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
            self._stop_workers()  # a hung worker is killed; fresh ones start on the next call
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
        """Stops the workers (a hung one is killed) and the judges' and code tests' threads."""
        for _, _, scorer in self.scorers:
            if scorer is not None:
                scorer.close()
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._pool is None:
            return
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


def _scorer(entry: RewardEntry, where: str):
    """The judge or code tests an entry names (None for a rule function: `Rewards._score`)."""
    if isinstance(entry, JudgeReward):
        return Judge(entry, where=where)
    return CodeTests(entry, where=where) if isinstance(entry, CodeReward) else None
