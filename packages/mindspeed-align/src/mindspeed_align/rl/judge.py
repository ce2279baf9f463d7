"""An LLM judge as an RL reward: any OpenAI-compatible chat-completions endpoint (vLLM, SGLang,
`mindspeed serve`, a hosted API) reads each completion through a prompt template and replies
with a score, which a regex finds and the configured range maps to [0, 1].

A `grpo.rewards` entry such as::

    - judge: http://127.0.0.1:8000/v1
      model: qwen2.5-7b-instruct
      template: "Question: {prompt}\\nAnswer: {completion}\\nReference: {reference}\\n..."

POSTs `{"model", "messages": [system?, user: the filled template], "temperature",
"max_tokens"}` to `{judge}/chat/completions`, many completions at once (a thread pool of
`max_concurrency`), each with `timeout_s` and `retries` (exponential backoff) on timeouts,
connection errors, 429 and 5xx. A completion whose request failed (HTTP error or a reply
that is not a chat completion), timed out every time, or whose reply holds no score in the
range scores 0 and is counted by cause (http_error, timeout, unparsed): the run goes on.

The standard library's urllib, not the `openai` client: one JSON POST is all the protocol
needs; `openai` (with httpx and pydantic) is only a dev tool here and would become a runtime
dependency of every trainer install; and its own retries would hide the failures we count.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mindspeed_core.errors import ConfigError, DataError

__all__ = ["DEFAULT_SCORE_REGEX", "DEFAULT_TEMPLATE", "Judge", "JudgeReward"]

logger = logging.getLogger("mindspeed.rl")

DEFAULT_TEMPLATE = (
    "Grade the response to the task below.\n\nTask:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "Rate how well the response accomplishes the task, from 0 (not at all) to 10 (perfectly). "
    "End your reply with a line of the form 'Score: N'."
)
DEFAULT_SCORE_REGEX = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
_FIELDS = re.compile(r"\{(prompt|completion|reference)\}")


@dataclass(kw_only=True)
class JudgeReward:
    """A `grpo.rewards` entry `{judge: URL, model: NAME, ...}`."""

    judge: str
    """The endpoint's base URL, e.g. http://127.0.0.1:8000/v1; requests go to
    {judge}/chat/completions."""
    model: str
    """The model name the endpoint serves (the request's "model")."""
    template: str = DEFAULT_TEMPLATE
    """The user message: {prompt}, {completion} and {reference} are replaced by the prompt
    text the policy saw, its completion and the record's reference field; nothing else in
    it is special (braces stay). Must name {completion}."""
    system: str | None = None
    """A system message before it (None: none)."""
    reference: str = "answer"
    """The record field that fills {reference}; the prompt records must have it when the
    template names {reference}."""
    score_regex: str = DEFAULT_SCORE_REGEX
    """Where the score is in the reply: the last match's first group (or the whole match
    when the pattern has no group), read as a number. Default: "Score: N"."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """[low, high] of the judge's scale: a score s in it becomes (s - low) / (high - low) in
    [0, 1]; one outside it is a parse failure (scored 0)."""
    max_tokens: int = 256
    """The reply's tokens at most."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, the same reply every time)."""
    timeout_s: float = 30.0
    """Seconds one request may wait for the server (each socket operation)."""
    retries: int = 2
    """Further tries after a timeout, a connection error, 429 or 5xx."""
    backoff_s: float = 1.0
    """Seconds before the first retry, doubling for each further one."""
    max_concurrency: int = 8
    """Requests in flight at once."""
    api_key_env: str | None = None
    """The environment variable holding the key sent as `Authorization: Bearer` (None:
    none; the key itself never goes in a config)."""
    weight: float | None = None
    """Its weight in the sum of rewards (None: grpo.reward_weights' entry, or 1.0)."""
    name: str = "judge"
    """Its name in the metrics: reward/NAME, reward/failures/NAME/CAUSE."""

    def check(self, where: str) -> None:
        """Raise ConfigError naming `where` (e.g. grpo.rewards[1]) and the bad field."""
        parts = urllib.parse.urlsplit(self.judge)
        try:
            parts.port  # noqa: B018  (a bad port raises here)
        except ValueError:
            parts = parts._replace(netloc="")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where}.judge={self.judge!r} is not an http(s) URL "
                              "(e.g. http://127.0.0.1:8000/v1)")  # fmt: skip
        if "{completion}" not in self.template:
            raise ConfigError(f"{where}.template does not name {{completion}}")
        try:
            re.compile(self.score_regex)
        except re.error as err:
            raise ConfigError(f"{where}.score_regex={self.score_regex!r}: {err}") from None
        low, high = self.score_range
        if not low < high:
            raise ConfigError(f"{where}.score_range=[{low}, {high}]: low must be below high")
        for field_name in ("timeout_s", "max_concurrency", "max_tokens"):
            if not getattr(self, field_name) > 0:
                raise ConfigError(f"{where}.{field_name}={getattr(self, field_name)} must be > 0")
        for field_name in ("retries", "backoff_s", "temperature"):
            if getattr(self, field_name) < 0:
                raise ConfigError(f"{where}.{field_name}={getattr(self, field_name)} must be >= 0")

    def columns(self) -> list[str]:
        """The record fields the template reads."""
        return [self.reference] if "{reference}" in self.template else []


class _Failed(Exception):
    def __init__(self, cause: str, message: str, retry: bool):
        super().__init__(message)
        self.cause, self.retry = cause, retry


class Judge:
    """Scores completions with the endpoint `cfg` names (one thread pool, kept until close)."""

    causes = ("http_error", "timeout", "unparsed")

    def __init__(self, cfg: JudgeReward, *, where: str = "grpo.rewards"):
        self.cfg, self.name, self.where = cfg, cfg.name, where
        self.url = cfg.judge.rstrip("/") + "/chat/completions"
        self.pattern = re.compile(cfg.score_regex)
        self.headers = {"content-type": "application/json"}
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ConfigError(f"{where}.api_key_env: ${cfg.api_key_env} is not set")
            self.headers["authorization"] = f"Bearer {key}"
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(a score per completion, failures by cause, {}): `rewards.Rewards`' scorer calls."""
        refs = [None] * len(completions)
        if self.cfg.columns():
            if self.cfg.reference not in columns:
                raise DataError(f"{self.where}.template reads {{reference}}, but the prompt "
                                f"records have no {self.cfg.reference!r} field")  # fmt: skip
            refs = columns[self.cfg.reference]
        bodies = [self.body(p, c, r) for p, c, r in zip(prompts, completions, refs, strict=True)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.max_concurrency, thread_name_prefix="judge")
        outcomes = list(self._pool.map(self._score, bodies))
        failures = dict.fromkeys(self.causes, 0)
        for _, cause, _ in outcomes:
            if cause is not None:
                failures[cause] += 1
        first = next((message for _, cause, message in outcomes if cause is not None), None)
        if first is not None:
            logger.warning("reward %s: %d of %d completions failed (%s; first: %s); scored 0",
                           self.name, sum(failures.values()), len(outcomes),
                           ", ".join(f"{k} {v}" for k, v in failures.items() if v), first)  # fmt: skip
        return [score for score, _, _ in outcomes], failures, {}

    def body(self, prompt: str, completion: str, reference=None) -> dict:
        """The request for one completion."""
        values = {"prompt": prompt, "completion": completion, "reference": str(reference)}
        text = _FIELDS.sub(lambda m: values[m.group(1)], self.cfg.template)
        messages = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return {"model": self.cfg.model, "messages": [*messages, {"role": "user", "content": text}],
                "temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens}  # fmt: skip

    def parse(self, reply: str) -> float | None:
        """The reply's score mapped to [0, 1], or None when it has none in the range."""
        matches = list(self.pattern.finditer(reply))
        if not matches:
            return None
        last = matches[-1]
        try:
            value = float(last.group(1) if self.pattern.groups else last.group(0))
        except (TypeError, ValueError):
            return None
        low, high = self.cfg.score_range
        return (value - low) / (high - low) if low <= value <= high else None

    def _score(self, body: dict) -> tuple[float, str | None, str | None]:
        """(score, failure cause or None, failure message or None) of one request."""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._post(body)
            except _Failed as err:
                failed = err
                if err.retry:
                    continue
                break
            score = self.parse(reply)
            if score is None:
                return 0.0, "unparsed", f"no score in the reply {reply[-200:]!r}"
            return score, None, None
        return 0.0, failed.cause, str(failed)

    def _post(self, body: dict) -> str:
        """The reply's text, or _Failed (with whether a retry may help)."""
        request = urllib.request.Request(self.url, json.dumps(body).encode(), self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            retry = err.code == 429 or err.code >= 500
            detail = err.read(200).decode(errors="replace")
            raise _Failed(
                "http_error", f"HTTP {err.code} from {self.url}: {detail}", retry
            ) from None
        except urllib.error.URLError as err:
            timed_out = isinstance(err.reason, TimeoutError)
            raise _Failed("timeout" if timed_out else "http_error",
                          f"{self.url}: {err.reason}", True) from None  # fmt: skip
        except TimeoutError:
            raise _Failed("timeout", f"{self.url}: no reply within {self.cfg.timeout_s:g} s",
                          True) from None  # fmt: skip
        except (ConnectionError, http.client.HTTPException) as err:
            raise _Failed("http_error", f"{self.url}: {type(err).__name__}: {err}", True) from None
        try:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise _Failed("http_error", f"{self.url}: the reply is not a chat completion "
                          f"({raw[:120]!r})", False)  # fmt: skip
        return text

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
