"""Text in, text out: prompts through a tokenizer, stop strings, streamed text.

Streaming never shows text that a later token could turn into a stop string: the tail
of the text that is the beginning of a stop string is held back until it is settled,
and so is an incomplete UTF-8 character (decoded as U+FFFD).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from mindspeed_llm.generation.config import GenerationConfig
from mindspeed_llm.generation.engine import TokenSteps
from mindspeed_llm.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
Prompt = str | Sequence[int]
"""A prompt: text, or token ids used as they are."""


@dataclass(frozen=True)
class Completion:
    """What one prompt produced."""

    text: str
    """The new text, without a stop string or stop token."""
    token_ids: list[int]
    """The new tokens, up to the one that completed a stop string, or the stop token."""
    finish_reason: str
    """"stop" (a stop token or stop string) or "length" (max_new_tokens or the context)."""


class TextStream:
    """The text of one row's tokens, released as soon as no stop string can claim it."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Sequence[str] = ()):
        self._decode = decode
        self._stops = tuple(stop_strings)
        self._longest = max((len(s) for s in self._stops), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._sent = 0  # characters of `text` already released

    def push(self, token: int) -> str:
        """Add a token; returns the newly released text (often empty)."""
        assert not self.stopped, "push after a stop string"
        self.ids.append(token)
        # Decoding the whole row each time keeps merges across tokens (bytes, spaces) right.
        text = self._decode(self.ids)
        hit = self._find_stop(text)
        if hit is not None:
            self.stopped = True
            self.text = text[: max(hit, self._sent)]
            return self._release(len(self.text))
        self.text = text
        settled = len(text.rstrip(_INCOMPLETE))
        return self._release(settled - self._pending_stop(text[self._sent : settled]))

    def flush(self) -> str:
        """The held-back rest, once the row is over."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        chunk = self.text[self._sent : end]
        self._sent = end
        return chunk

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self._sent - self._longest + 1)
        hits = [i for s in self._stops if (i := text.find(s, start)) >= 0]
        return min(hits, default=None)

    def _pending_stop(self, tail: str) -> int:
        """Length of the longest end of `tail` that begins some stop string."""
        for n in range(min(len(tail), self._longest - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stops):
                return n
        return 0


class Generator:
    """A model and its tokenizer: `generate(prompts)`, `complete(prompts)`, `stream(prompt)`.

    Text prompts go through `encode`; token-id prompts are used as they are. Generation
    stops at `config.stop_token_ids`, or at the tokenizer's EOS when the config names none.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, config: GenerationConfig | None = None
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or GenerationConfig()
        specials = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of `text`: special-token pieces in it (as chat templates write them)
        become their ids, and with `add_bos` the tokenizer's BOS, if it has one, comes
        first unless the text already begins with it (as transformers' tokenizers do)."""
        tok, ids, pos = self.tokenizer, [], 0
        for match in self._special_re.finditer(text) if self._special_re else ():
            ids += tok.encode(text[pos : match.start()]) if match.start() > pos else []
            ids.append(tok.special_tokens[match.group()])
            pos = match.end()
        ids += tok.encode(text[pos:]) if pos < len(text) or not ids else []
        if add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    def generate(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None, **overrides: Any
    ) -> list[str]:
        """The new text of each prompt (a stop string and stop token left out).

        `config` (default: this generator's) and `overrides` of its fields choose how.
        """
        return [c.text for c in self.complete(prompts, config, **overrides)]

    def complete(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None, **overrides: Any
    ) -> list[Completion]:
        """Like `generate`, with the new tokens and why each row ended."""
        run = _Run(self, prompts, self.resolved_config(config, **overrides))
        for _ in run.chunks():
            pass
        return run.completions()

    def stream(
        self, prompt: Prompt, config: GenerationConfig | None = None, **overrides: Any
    ) -> Iterator[str]:
        """The new text of one prompt, piece by piece as it is generated."""
        run = _Run(self, [prompt], self.resolved_config(config, **overrides))
        for _, chunk in run.chunks():
            yield chunk

    def resolved_config(
        self, config: GenerationConfig | None = None, **overrides: Any
    ) -> GenerationConfig:
        """`config` (default: this generator's) with `overrides` and the EOS stop."""
        config = (config or self.config).replace(**overrides)
        if not config.stop_token_ids and self.tokenizer.eos_id is not None:
            config = config.replace(stop_token_ids=(self.tokenizer.eos_id,))
        return config


class _Run:
    """One call of a `Generator`: the token steps and a `TextStream` per row."""

    def __init__(self, generator: Generator, prompts: Sequence[Prompt], config: GenerationConfig):
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of prompts; use stream() for one")
        ids = [generator.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        self.steps = TokenSteps(generator.model, ids, config)
        decode = generator.tokenizer.decode
        self.streams = [TextStream(decode, config.stop_strings) for _ in self.steps.prompts]
        self.stop_ids = frozenset(config.stop_token_ids)

    def chunks(self) -> Iterator[tuple[int, str]]:
        """(row, text) as it is released; the held-back rest comes last."""
        for new in self.steps:
            for row, token in new:
                if token in self.stop_ids:
                    continue
                chunk = self.streams[row].push(token)
                if self.streams[row].stopped:
                    self.steps.finish(row)
                if chunk:
                    yield row, chunk
        for row, stream in enumerate(self.streams):
            if chunk := stream.flush():
                yield row, chunk

    def completions(self) -> list[Completion]:
        done = []
        for tokens, stream in zip(self.steps.outputs, self.streams, strict=True):
            stopped = stream.stopped or bool(tokens and tokens[-1] in self.stop_ids)
            done.append(Completion(stream.text, list(tokens), "stop" if stopped else "length"))
        return done
