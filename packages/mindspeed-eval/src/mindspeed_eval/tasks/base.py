"""What every benchmark runner is made of: items read from local files, prompts in three
modes, and a grade per item.

Prompt modes (MindSpeed-LLM's three ways to ask):

- ``ppl``: the n-shot text prompt; each choice is scored by log-likelihood and the most
  likely one is the answer (MindSpeed-LLM's ``mmlu_ppl``, and lm-eval's multiple choice).
- ``direct``: the same n-shot text prompt, greedy generation, the answer extracted from
  the text (MindSpeed-LLM's default).
- ``chat``: the shots as chat turns through the model's chat template, then generation
  (MindSpeed-LLM's ``--prompt-type`` path).

An item without choices (free-form answers) is always generated.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mindspeed_core.errors import DataError
from mindspeed_core.files import read_text

MODES = ("ppl", "direct", "chat")
LETTERS = "ABCDEFGHIJ"


@dataclass
class Item:
    """One question of a benchmark."""

    subject: str
    prompt: str
    """The text prompt (shots included) for `ppl` and `direct`."""
    target: str
    """The correct answer, as `Task.answer` extracts it (e.g. "B")."""
    choices: tuple[str, ...] = ()
    """Continuations scored in `ppl` mode, in the order of `labels`."""
    labels: tuple[str, ...] = ()
    """The answer each choice stands for (default: A, B, C, ...)."""
    messages: list[dict] | None = None
    """The conversation for `chat` mode (default: the prompt as one user turn)."""
    meta: dict[str, Any] = field(default_factory=dict)

    def label(self, index: int) -> str:
        return (self.labels or tuple(LETTERS))[index]


class Task:
    """A benchmark: how to read its local files and how to grade an answer."""

    name: ClassVar[str]
    layout: ClassVar[str]
    """One line naming the expected files (shown when a folder does not fit)."""
    modes: ClassVar[tuple[str, ...]] = MODES
    """Supported modes, the default first."""
    default_shots: ClassVar[int] = 0
    until: ClassVar[tuple[str, ...]] = ("\n",)
    """Stop strings of generated answers."""
    max_gen_toks: ClassVar[int] = 16

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        """Every item under `data`; `fewshot` is a MindSpeed-LLM few-shot template JSON
        ({subject: text}) that replaces the shots read from the data when given.

        Raises:
            DataError: the folder does not hold this benchmark's layout (the message names
                the file and what was expected).
        """
        raise NotImplementedError

    def answer(self, item: Item, text: str) -> str:
        """The answer in a generated text (default: the first choice letter)."""
        match = re.search(r"\b([A-J])\b", text)
        return match.group(1) if match else text.strip()

    def grade(self, items: list[Item], outputs: list[str]) -> list[dict]:
        """Per item {"answer", "correct"} from extracted answers (or generated texts)."""
        return [
            {"answer": answer, "correct": answer == item.target}
            for item, answer in zip(items, outputs, strict=True)
        ]

    def missing(self, data: Path, detail: str) -> DataError:
        return DataError(f"{data}: {detail}; {self.name} expects {self.layout}")


# -- readers that name the file and line of a problem --------------------------------------


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    """Objects of a JSONL file, each holding `required` keys."""
    rows = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{number}: not valid JSON: {err}") from None
        _require(row, required, f"{path}:{number}")
        rows.append(row)
    return rows


def read_json(path: Path) -> Any:
    try:
        return json.loads("\n".join(_lines(path)))
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON: {err}") from None


def read_csv(path: Path, columns: tuple[str, ...], *, header: bool) -> list[dict]:
    """Rows of a CSV as dicts; `header` files name their columns (at least `columns`),
    headerless ones hold exactly `columns` in order (MMLU)."""
    rows = list(csv.reader(_lines(path)))
    if header:
        if not rows:
            raise DataError(f"{path}: empty file, expected a header with {', '.join(columns)}")
        names = [c.strip() for c in rows[0]]
        _require(dict.fromkeys(names), columns, f"{path}:1 (header)")
        start, rows = 2, rows[1:]
    else:
        names, start = list(columns), 1
    out = []
    for number, row in enumerate(rows, start):
        if not row:
            continue
        if len(row) != len(names):
            raise DataError(
                f"{path}:{number}: expected {len(names)} columns ({', '.join(names)}), "
                f"got {len(row)}"
            )
        out.append(dict(zip(names, row, strict=True)))
    return out


def _lines(path: Path) -> list[str]:
    return read_text(path).splitlines()


def _require(row: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with {', '.join(keys)}")
    missing = [k for k in keys if k not in row]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)} (expected {', '.join(keys)})")


def subject_of(path: Path) -> str:
    """MindSpeed-LLM's rule: the file name without `_test`/`_val`/`_dev` and extension."""
    return re.sub(r"(?:_test|_val|_dev)?\.\w+$", "", path.name)


def split_folder(data: Path, split: str, suffix: str) -> Path:
    """`data/split` when it exists, else `data` itself (the split folder was given)."""
    inner = data / split
    if inner.is_dir():
        return inner
    return data if any(data.glob(f"*{suffix}")) else inner
