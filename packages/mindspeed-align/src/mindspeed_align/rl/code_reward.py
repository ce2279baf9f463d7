"""A code-execution reward: the reply's last fenced Python block runs in the code sandbox
(`mindspeed_core.sandbox`: no network, time, memory and process limits) against the record's
tests.

A `grpo.rewards` entry such as ``{code: tests, timeout_s: 10}`` reads the record field
`tests`: a list of test snippets (each an assert line or a few lines), or one string (a
test program, which counts as one test). One program per completion runs the code, then
each test in the code's namespace, and prints how many passed after a marker the code
cannot know in advance. Score ``all`` (default): 1.0 when every test passed, else 0.0 (pass@1,
as DeepSeek-R1's and verl's code rewards); ``fraction``: passed / tests (open-r1's). A reply
without a closed ```python (or ```py, or bare ```) block, code that raises, a program that
runs past `timeout_s` or exits before reporting all score 0: those are the policy's doing,
logged as fractions (`reward/NAME/no_code`, `reward/NAME/timeouts`), not reward failures.
The program judges what it reports: it is not hardened against a policy that rewrites the
harness from inside (as no in-process test runner is); the sandbox bounds what that costs.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.sandbox import SandboxLimits, run_program

__all__ = ["CodeReward", "CodeTests", "last_code_block"]

logger = logging.getLogger("mindspeed.rl")

_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_HARNESS = """\
import sys
_code, _tests, _marker = {code!r}, {tests!r}, {marker!r}
_namespace, _passed = {{"__name__": "solution"}}, 0
try:
    exec(compile(_code, "solution.py", "exec"), _namespace)
except BaseException:
    _tests = ()
for _i, _test in enumerate(_tests):
    try:
        exec(compile(_test, f"test_{{_i}}.py", "exec"), _namespace)
        _passed += 1
    except BaseException:
        pass
sys.stdout.flush()
print()
print(_marker, _passed, flush=True)
"""


def last_code_block(text: str) -> str | None:
    """The last closed fenced block labelled python/py (or unlabelled), or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


@dataclass(kw_only=True)
class CodeReward:
    """A `grpo.rewards` entry `{code: FIELD, ...}`."""

    code: str
    """The record field holding the tests: a list of snippets (assert lines) or one test
    program (a string)."""
    score: Literal["all", "fraction"] = "all"
    """all: 1 when every test passes, else 0; fraction: the share of tests that pass."""
    timeout_s: float = 10.0
    """Wall-clock seconds for one completion's program (code and tests)."""
    memory_mb: int = 1024
    """Address space of the program (MiB)."""
    max_concurrency: int = 4
    """Programs running at once (each a subprocess)."""
    weight: float | None = None
    """Its weight in the sum of rewards (None: grpo.reward_weights' entry, or 1.0)."""
    name: str = "code"
    """Its name in the metrics: reward/NAME, reward/NAME/no_code, reward/NAME/timeouts."""

    def check(self, where: str) -> None:
        """Raise ConfigError naming `where` (e.g. grpo.rewards[2]) and the bad field."""
        if not self.code:
            raise ConfigError(f"{where}.code: name the record field that holds the tests")
        if self.score not in ("all", "fraction"):
            raise ConfigError(f"{where}.score={self.score!r} is not all or fraction")
        for field_name in ("timeout_s", "memory_mb", "max_concurrency"):
            if not getattr(self, field_name) > 0:
                raise ConfigError(f"{where}.{field_name}={getattr(self, field_name)} must be > 0")

    def columns(self) -> list[str]:
        return [self.code]


class CodeTests:
    """Runs completions' code against their records' tests in the sandbox."""

    causes = ("error",)

    def __init__(self, cfg: CodeReward, *, where: str = "grpo.rewards"):
        self.cfg, self.name, self.where = cfg, cfg.name, where
        self.limits = SandboxLimits(timeout_s=cfg.timeout_s, cpu_s=math.ceil(cfg.timeout_s) + 1,
                                    memory_mb=cfg.memory_mb)  # fmt: skip
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(a score per completion, failures by cause, the fractions that had no code or
        timed out): `rewards.Rewards`' scorer calls."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.max_concurrency, thread_name_prefix="code")
        if self.cfg.code not in columns:
            raise DataError(f"{self.where}: the prompt records have no {self.cfg.code!r} field "
                            "(the tests)")  # fmt: skip
        tests = columns[self.cfg.code]
        outcomes = list(self._pool.map(self._score, completions, tests))
        n = max(len(outcomes), 1)
        errors = [o for _, o in outcomes if o not in ("ok", "no_code", "timeout")]
        if errors:
            logger.warning("reward %s: %d of %d completions failed (first: %s); scored 0",
                           self.name, len(errors), len(outcomes), errors[0])  # fmt: skip
        fractions = {
            kind: sum(o == kind for _, o in outcomes) / n for kind in ("no_code", "timeout")
        }
        return ([s for s, _ in outcomes], {"error": len(errors)},
                {"no_code": fractions["no_code"], "timeouts": fractions["timeout"]})  # fmt: skip

    def _score(self, completion: str, tests) -> tuple[float, str]:
        """(score, "ok" | "no_code" | "timeout" | what went wrong)."""
        if isinstance(tests, str):
            tests = [tests]
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            return 0.0, f"the {self.cfg.code!r} field is not a test string or a list of them"
        code = last_code_block(completion)
        if code is None:
            return 0.0, "no_code"
        marker = f"mindspeed-tests-{secrets.token_hex(16)}"
        try:
            result = run_program(
                _HARNESS.format(code=code, tests=tests, marker=marker), self.limits
            )
        except OSError as err:  # the sandbox could not start (no space, no processes left)
            return 0.0, f"the sandbox did not start: {err}"
        if result.status == "timeout":
            return 0.0, "timeout"
        lines = result.stdout.rstrip("\n").rsplit("\n", 1)
        last = lines[-1].split()
        if not result.passed or len(last) != 2 or last[0] != marker or not last[1].isdigit():
            return 0.0, "ok"  # exited early (os._exit, a limit): nothing passed for sure
        passed = min(int(last[1]), len(tests))
        if self.cfg.score == "all":
            return float(passed == len(tests)), "ok"
        return passed / len(tests), "ok"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
