"""What to generate: length, sampling, stops; optionally read from a `generation_config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_core.errors import ConfigError

FILENAME = "generation_config.json"


@dataclass(kw_only=True, frozen=True)
class GenerationConfig:
    """Decoding settings, with Hugging Face's meaning for every shared name.

    The defaults are Hugging Face's: greedy, and top_k 50 once sampling is on.
    """

    max_new_tokens: int = 256
    """New tokens per prompt at most (fewer if the model's context ends first)."""
    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 50
    """When sampling, keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """When sampling, keep the smallest set of tokens whose probability reaches top_p."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the prompt or the
    output by this (1.0: off), before temperature; greedy decoding uses it too."""
    stop_token_ids: tuple[int, ...] = ()
    """Generating any of these ends the row (the token is the last one returned)."""
    stop_strings: tuple[str, ...] = ()
    """Text-level stops (`Generator` only): the text ends before the first occurrence."""
    seed: int | None = None
    """Seed of the sampling generator (None: a fresh one; every tp rank draws the same)."""
    use_cache: bool = True
    """Keep keys and values (the fast path); False recomputes the whole sequence per token."""
    compile: bool = False
    """torch.compile the model's blocks for decoding, in place and once (dynamic shapes:
    a graph for the prefill, one for every decode step); the first call pays for it."""
    num_return_sequences: int = 1
    """Outputs per prompt (n samples: RL rollouts, pass@k), prompt-major; with the cache
    every prompt is prefilled once and its keys and values are shared by its n rows."""
    num_beams: int = 1
    """> 1: beam search (deterministic; `generation.beam`) keeping this many beams per prompt;
    `num_return_sequences` of them (the best first) are returned."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores sum(log p) / length ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search: True stops a prompt once num_beams beams have finished; False when no
    running beam could beat the finished ones at its current length; "never" also allows for
    longer beams (transformers' meanings)."""

    def __post_init__(self):
        for name in ("stop_token_ids", "stop_strings"):  # lists from JSON or callers
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.num_return_sequences < 1:
            raise ConfigError(
                f"num_return_sequences must be at least 1, got {self.num_return_sequences}"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not s for s in self.stop_strings):
            raise ConfigError("stop_strings must not contain an empty string")
        if self.num_beams < 1:
            raise ConfigError(f"num_beams must be at least 1, got {self.num_beams}")
        if not math.isfinite(self.length_penalty):
            raise ConfigError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ConfigError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        if self.num_beams > 1:
            if self.num_return_sequences > self.num_beams:
                raise ConfigError(
                    f"num_return_sequences={self.num_return_sequences} exceeds "
                    f"num_beams={self.num_beams}: a beam search returns at most its beams"
                )
            if not self.greedy or self.repetition_penalty != 1.0 or not self.use_cache:
                raise ConfigError(
                    f"num_beams={self.num_beams}: beam search here is deterministic, with the "
                    "KV cache and no repetition penalty (temperature 0, repetition_penalty 1, "
                    "use_cache true)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with `changes`; None values are ignored (unset command-line options)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> GenerationConfig:
        """Defaults from a Hugging Face `generation_config.json` (or the folder holding one).

        `do_sample` false or absent means greedy, as in transformers; sampling keeps the
        file's temperature, top_k (default 50) and top_p; `eos_token_id` (one id or a
        list) becomes `stop_token_ids`. `overrides` (None ignored) win over the file.

        Raises:
            ConfigError: the file is missing, not JSON, or holds a value out of range.
        """
        p = Path(path)
        if p.is_dir():
            p = p / FILENAME
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"generation config not found: {p}") from None
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read generation config {p}: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"generation config {p} is not a JSON object")
        try:
            config = cls(**_fields_from_hf(data))
        except (TypeError, ValueError, ConfigError) as err:
            raise ConfigError(f"generation config {p}: {err}") from None
        return config.replace(**overrides)


def _fields_from_hf(data: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if data.get("max_new_tokens") is not None:
        fields["max_new_tokens"] = int(data["max_new_tokens"])
    if data.get("do_sample"):
        fields["temperature"] = float(data.get("temperature") or 1.0)
    for name, kind in (("top_k", int), ("top_p", float), ("repetition_penalty", float)):
        if data.get(name) is not None:
            fields[name] = kind(data[name])
    if not data.get("do_sample"):  # beam sampling is not built: a sampling file keeps sampling
        for name, kind in (("num_beams", int), ("length_penalty", float)):
            if data.get(name) is not None:
                fields[name] = kind(data[name])
        if data.get("early_stopping") is not None:
            fields["early_stopping"] = data["early_stopping"]
    eos = data.get("eos_token_id")
    if eos is not None:
        fields["stop_token_ids"] = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return fields


def load_generation_config(folder: str | os.PathLike | None, **overrides: Any) -> GenerationConfig:
    """`GenerationConfig.from_file` when `folder` holds a generation_config.json, else the
    defaults; `overrides` (None ignored) apply either way."""
    if folder is not None and (Path(folder) / FILENAME).is_file():
        return GenerationConfig.from_file(folder, **overrides)
    return GenerationConfig().replace(**overrides)
