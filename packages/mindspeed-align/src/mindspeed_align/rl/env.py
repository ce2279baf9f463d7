"""Multi-turn, tool-using rollouts: an `Environment` answers each reply of the policy
until the episode ends; only the policy's own tokens are trained.

An environment is made fresh for every episode (so it may keep the episode's state, such
as the record's answer) and has two methods (verl's and OpenRLHF's agent loops have the
same shape):

    reset(record) -> messages                 the conversation the policy starts from
    step(messages, reply) -> (observation, reward, done)
        messages: the conversation so far (the reply not yet in it); reply: the reply's
        text; observation: the messages to append (tool turns) when the episode goes on.

and may name its tools in a class attribute `tools` (JSON schemas, as transformers'
`apply_chat_template(tools=...)` takes them): every rendering passes them to the chat
template, which describes them to the model (Qwen's and Hermes' templates do, in the
system turn).

`run_episodes` samples `n` episodes of each record. Turn one samples every episode of a
prompt from one prefill (as single-turn GRPO does); each later turn continues every live
episode from its own token history. The tokens between two replies (the end of the
reply's turn, the tool turns, the next generation prompt) are the template's own
rendering of the new turns, tokenized apart and appended as they are: the history is
never re-tokenized, so the trained tokens are exactly the sampled ones. Those tokens are
masked (`RolloutBatch.response_mask` 0): the loss sees the policy's tokens alone.

Budgets: `max_turns` replies and `max_tokens` response tokens (replies plus observations)
per episode. An episode past either, or whose environment raised, scores 0, is counted in
the metrics (`env/over_budget`, `env/errors`) and the run goes on.

Tool calls are read in the Qwen/Hermes format: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` anywhere in the reply (`parse_tool_calls`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.chat_template import encode_text

__all__ = [
    "Environment",
    "Episodes",
    "ToolCall",
    "load_environment",
    "observation_ids",
    "parse_tool_calls",
    "run_episodes",
]

logger = logging.getLogger("mindspeed.grpo")

Message = dict[str, Any]


class Environment(Protocol):
    def reset(self, record: dict[str, Any]) -> list[Message]: ...

    def step(
        self, messages: list[Message], reply: str
    ) -> tuple[list[Message], float, bool]: ...


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (then name and arguments are empty)."""


_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(reply: str) -> list[ToolCall]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of `reply`, in
    order (an unclosed last block runs to the end). A block that is not a JSON object with a
    string "name" (and a dict "arguments", "{}" when absent; a JSON string holding one is
    read too, as some models write it) is returned with `error` saying why."""
    calls = []
    for match in _TOOL_CALL.finditer(reply):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({err.msg}): {body[:80]}"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(None, error='a tool call needs a JSON object with a "name" string'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            calls.append(ToolCall(None, error=f'the "arguments" of {value["name"]} must be an object'))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def load_environment(spec: str, *, section: str = "grpo") -> Callable[[], Environment]:
    """The environment class (one instance per episode) that `spec` names: `calculator`
    (the embedded demo's) or "module:Class" (constructed without arguments).

    Raises:
        ConfigError: the spec names nothing importable, or not an environment.
    """
    if spec == "calculator":  # named, not imported here: calculator builds on this module
        spec = "mindspeed_align.rl.calculator:CalculatorEnv"
    module_name, _, attr = spec.partition(":")
    if not (module_name and attr):
        raise ConfigError(f'{section}.env={spec!r}: "calculator" or "module:Class"')
    import importlib

    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{section}.env={spec!r}: cannot import it ({err})") from None
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ConfigError(f"{section}.env={spec!r} has no reset(record) and step(messages, reply)")
    return cls


def observation_ids(template, tokenizer, history: list[Message], reply: str,
                    observation: list[Message], *, stop_text: str | None,
                    tools: list | None = None) -> list[int]:  # fmt: skip
    """The tokens after a sampled reply that bring the conversation to the next reply: the
    template's rendering of [*history, reply, *observation] with the generation prompt,
    past the rendering of `history` with the generation prompt plus the reply's text. When
    the reply stopped on the stop token whose text opens that rest (the end of its turn),
    that text is already sampled and is left out.

    Raises:
        DataError: the template does not render the reply as generated (it rewrites past
            turns), so no token history can continue it.
    """
    head = template.render(history, add_generation_prompt=True, tools=tools) + reply
    full = template.render([*history, {"role": "assistant", "content": reply}, *observation],
                           add_generation_prompt=True, tools=tools)  # fmt: skip
    if not full.startswith(head):
        raise DataError(f"chat template {template.origin} renders a past reply otherwise than "
                        "it was generated; multi-turn rollouts need one that does not")  # fmt: skip
    rest = full[len(head):]
    if stop_text and rest.startswith(stop_text):
        rest = rest[len(stop_text):]
    return encode_text(tokenizer, rest)


@dataclass
class Episodes:
    """`n` episodes of each record, as a `RolloutBatch` (response = every token after the
    prompt, `response_mask` 1 on the policy's), the episodes' rewards and the metrics."""

    batch: Any
    rewards: list[float]
    metrics: dict[str, float]


@dataclass
class _Episode:
    group: int
    env: Environment
    messages: list[Message]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    stopped: bool = False
    done: bool = False


def run_episodes(rollout, make_env: Callable[[], Environment], records: Sequence[dict[str, Any]],
                 prompt_ids: Sequence[Sequence[int]], cfg, *, template, tokenizer, seed: int,
                 max_turns: int, max_tokens: int) -> Episodes:  # fmt: skip
    """`cfg.n` episodes of each record (see the module's docstring). `rollout` is a
    `LocalRollout`, `cfg` its `SamplingConfig` (max_new_tokens: per reply)."""
    from mindspeed_align.rl.rollout import RolloutBatch

    stops = set(cfg.stop_token_ids)
    stop_text = {t: _token_text(tokenizer, t) for t in stops}
    episodes = []
    for g in range(len(records)):
        for _ in range(cfg.n):
            env = make_env()
            episodes.append(_Episode(g, env, list(env.reset(records[g]))))
    counts = {"errors": 0, "over_budget": 0}
    step = _Step(template, tokenizer, stops, stop_text, max_turns, max_tokens, counts)
    seconds = 0.0
    live = list(range(len(episodes)))
    turn = 0
    while live:
        if turn == 0:
            out = rollout.generate(prompt_ids, cfg, seed=seed)
        else:
            contexts = [list(prompt_ids[episodes[i].group]) + episodes[i].tokens for i in live]
            out = rollout.generate(contexts, replace(cfg, n=1), seed=seed + 7919 * turn)
        seconds += out.seconds
        live = [i for i, reply, logps in zip(live, out.response_ids, out.sampler_logprobs, strict=True)
                if step.take(episodes[i], reply, logps)]  # fmt: skip
        turn += 1
    batch = RolloutBatch(
        prompt_ids=[list(prompt_ids[e.group]) for e in episodes],
        response_ids=[e.tokens for e in episodes],
        sampler_logprobs=[e.logps for e in episodes],
        group=[e.group for e in episodes],
        stopped=[e.stopped for e in episodes],
        seconds=seconds,
        response_mask=[e.mask for e in episodes],
    )
    n = len(episodes)
    metrics = {
        "env/turns": sum(e.turns for e in episodes) / n,
        "env/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "env/done_fraction": sum(e.done for e in episodes) / n,
        "env/errors": float(counts["errors"]),
        "env/over_budget": float(counts["over_budget"]),
    }
    return Episodes(batch, [e.reward for e in episodes], metrics)


@dataclass
class _Step:
    """What `run_episodes` does with each sampled reply (`take`)."""

    template: Any
    tokenizer: Any
    stops: set[int]
    stop_text: dict[int, str | None]
    max_turns: int
    max_tokens: int
    counts: dict[str, int]

    def take(self, e: _Episode, reply: list[int], logps: list[float]) -> bool:
        """Append the reply (cut to the token budget) to episode `e`, let its environment
        answer, append the observation's tokens; True when the episode goes on."""
        room = self.max_tokens - len(e.tokens)
        over = len(reply) > room
        reply, logps = reply[:room], logps[:room]
        e.tokens += reply
        e.mask += [1] * len(reply)
        e.logps += logps
        e.turns += 1
        e.stopped = bool(reply) and reply[-1] in self.stops
        if over:
            return _end(e, self.counts, "over_budget")
        vocab = self.tokenizer.vocab_size  # a model's table may have more rows than the tokenizer
        text = self.tokenizer.decode([t for t in reply if t not in self.stops and t < vocab])
        try:
            observation, reward, done = e.env.step(list(e.messages), text)
            observation, reward = _messages(observation), float(reward)
        except Exception as err:  # the environment's own failure scores this episode 0
            if not self.counts["errors"]:
                logger.warning("environment %s raised on an episode (scored 0, run goes on): %r",
                               type(e.env).__name__, err)  # fmt: skip
            return _end(e, self.counts, "errors")
        e.reward += reward
        e.tool_calls += "<tool_call>" in text
        if done:
            e.done = True
            return False
        if e.turns >= self.max_turns:
            return _end(e, self.counts, "over_budget")
        ids = observation_ids(self.template, self.tokenizer, e.messages, text, observation,
                              stop_text=self.stop_text.get(reply[-1]) if e.stopped else None,
                              tools=getattr(e.env, "tools", None))  # fmt: skip
        e.messages += [{"role": "assistant", "content": text}, *observation]
        if len(e.tokens) + len(ids) >= self.max_tokens:  # no room for one more reply token
            return _end(e, self.counts, "over_budget")
        e.tokens += ids
        e.mask += [0] * len(ids)
        e.logps += [0.0] * len(ids)
        return True


def _messages(observation) -> list[Message]:
    """An environment's observation, checked: a list of {"role": str, "content": str}.

    Raises:
        TypeError: it is not (the episode is then an environment error).
    """
    if not isinstance(observation, (list, tuple)) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observation
    ):
        raise TypeError(f"step() must return a list of {{role, content}} messages, got {observation!r:.80}")
    return list(observation)


def _end(e: _Episode, counts: dict[str, int], why: str) -> bool:
    """The episode ends unfinished: scored 0, counted under `why`; False (it does not go on)."""
    e.reward, e.done = 0.0, False
    counts[why] += 1
    return False


def _token_text(tokenizer, token: int) -> str | None:
    """The text a stop token stands for in rendered templates (`</s>`, `<|im_end|>`)."""
    return next((text for text, ident in tokenizer.special_tokens.items() if ident == token), None)
