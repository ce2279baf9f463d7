"""Text in, text out: prompts through a tokenizer, stop strings, streamed text.

Streaming never shows text that a later token could turn into a stop string: the tail
of the text that is the beginning of a stop string is held back until it is settled,
and so is an incomplete UTF-8 character (decoded as U+FFFD).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from mindspeed_llm.generation.config import GenerationConfig
from mindspeed_llm.generation.engine import TokenSteps
from mindspeed_llm.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


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
    """A model and its tokenizer: `generate(texts)` and `stream(text)`.

    Prompts get the tokenizer's BOS when it has one and the text does not already begin
    with it (as transformers' tokenizers do); special-token pieces in the text (as chat
    templates write them) become their ids. Generation stops at `config.stop_token_ids`,
    or at the tokenizer's EOS when the config names none.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, config: GenerationConfig | None = None
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or GenerationConfig()
        specials = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids."""
        tok, ids, pos = self.tokenizer, [], 0
        for match in self._special_re.finditer(text) if self._special_re else ():
            ids += tok.encode(text[pos : match.start()]) if match.start() > pos else []
            ids.append(tok.special_tokens[match.group()])
            pos = match.end()
        ids += tok.encode(text[pos:]) if pos < len(text) or not ids else []
        if tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    def generate(
        self, texts: Sequence[str], config: GenerationConfig | None = None, **overrides: Any
    ) -> list[str]:
        """The completion of each prompt (a stop string and stop token left out)."""
        pieces = [[] for _ in texts]
        for row, chunk in self._chunks(texts, config, overrides):
            pieces[row].append(chunk)
        return ["".join(p) for p in pieces]

    def stream(
        self, text: str, config: GenerationConfig | None = None, **overrides: Any
    ) -> Iterator[str]:
        """The completion of one prompt, piece by piece as it is generated."""
        for _, chunk in self._chunks([text], config, overrides):
            yield chunk

    def resolved_config(
        self, config: GenerationConfig | None = None, **overrides: Any
    ) -> GenerationConfig:
        """`config` (default: this generator's) with `overrides` and the EOS stop."""
        config = (config or self.config).replace(**overrides)
        if not config.stop_token_ids and self.tokenizer.eos_id is not None:
            config = config.replace(stop_token_ids=(self.tokenizer.eos_id,))
        return config

    def _chunks(self, texts, config, overrides) -> Iterator[tuple[int, str]]:
        config = self.resolved_config(config, **overrides)
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings; use stream() for one")
        steps = TokenSteps(self.model, [self.encode(t) for t in texts], config)
        streams = [TextStream(self.tokenizer.decode, config.stop_strings) for _ in texts]
        stop_ids = set(config.stop_token_ids)
        for new in steps:
            for row, token in new:
                if token in stop_ids:
                    continue
                chunk = streams[row].push(token)
                if streams[row].stopped:
                    steps.finish(row)
                if chunk:
                    yield row, chunk
        for row, stream in enumerate(streams):
            if chunk := stream.flush():
                yield row, chunk
