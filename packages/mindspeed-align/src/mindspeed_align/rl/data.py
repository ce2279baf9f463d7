"""Prompts for online RL: a JSONL file or the demo task, tokenized once, served per
data-parallel rank in a resumable order.

Record: {"prompt": str, ...} or {"messages": [{"role": ..., "content": ...}, ...], ...};
every other field is a column the reward functions get (one value per completion, e.g.
"answer"). Chat records are rendered by `data.chat_template` with the generation prompt
(`render_prompts`); the rendered text is the prompt the model continues and the reward
sees. The last `data.eval_prompts` records are held out for the before/after evaluation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from mindspeed_core.errors import DataError
from mindspeed_core.files import text_lines
from mindspeed_llm.chat_template import encode_text
from mindspeed_llm.demo import COLORS, NAMES, NUMBER_WORDS, PLACES, THINGS

__all__ = ["PromptSource", "demo_records", "read_prompts", "render_prompts"]


def demo_records(count: int, seed: int) -> list[dict[str, Any]]:
    """The demo task: the pretrain demo's stories cut before the sum ("... 3 plus 2 is"),
    answer the sum."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.sample(NAMES, 2)
        thing, place, color = rng.choice(THINGS), rng.choice(PLACES), rng.choice(COLORS)
        x, y = rng.randint(0, 5), rng.randint(0, 5)
        prompt = (
            f"{a} went to the {place} with {b}. {a} had {NUMBER_WORDS[x]} {color} {thing} "
            f"and {b} had {NUMBER_WORDS[y]}. {x} plus {y} is"
        )
        records.append({"prompt": prompt, "answer": x + y})
    return records


def read_prompts(path: Path, required: dict[str, str] | None = None, *,
                 any_record: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """The records of a JSONL file; a line without a "prompt" string is refused, and so is
    one without a column a reward needs (`required`: {column: the reward that needs it}).
    `any_record`: every JSON object is a record (an environment reads them)."""
    if not Path(path).is_file():
        raise DataError(f"data.prompts: no file {path}")
    records = []
    for number, line in text_lines(path, "data.prompts file"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: a record must be a JSON object")
        if "messages" in record:
            _check_messages(record["messages"], f"{path}:{number}")
        elif not any_record and not isinstance(record.get("prompt"), str):
            raise DataError(f'{path}:{number}: a record needs a "prompt" string or a "messages" list')
        for column, spec in (required or {}).items():
            if column not in record:
                raise DataError(f'{path}:{number}: no "{column}" field, which the reward '
                                f"{spec} needs")  # fmt: skip
        records.append(record)
    if not records:
        raise DataError(f"{path}: no prompts")
    return records


def _check_messages(messages: Any, where: str) -> None:
    """A chat prompt: a list of {"role": str, "content": str} with a user turn."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of turns')
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str)):  # fmt: skip
            raise DataError(f'{where}: messages[{i}] needs a "role" and a "content" string')
    if not any(turn["role"] == "user" for turn in messages):
        raise DataError(f"{where}: the messages have no user turn")


def render_prompts(records: list[dict[str, Any]], template, *, source: str,
                   tools: list | None = None) -> None:  # fmt: skip
    """Each record's prompt text, in place: its "messages" (or, for a {"prompt": ...}
    record, the prompt as one user turn) rendered by `template` (a `ChatTemplate`) with
    the generation prompt, as transformers' `apply_chat_template(add_generation_prompt=
    True, tokenize=False)` renders them (`tools`: the tool schemas, passed as its `tools`).
    The rendered text goes in "prompt".

    Raises:
        DataError: the template refuses a record (named by its index in `source`).
    """
    for i, record in enumerate(records):
        turns = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        _check_messages(turns, f"{source}: record {i}")
        try:
            record["prompt"] = template.render(turns, add_generation_prompt=True, tools=tools)
        except DataError as err:
            raise DataError(f"{source}: record {i}: {err}") from None


class PromptSource:
    """This rank's prompts of each step, in an order drawn once from the seed.

    Args:
        records: the training prompts (dicts with "prompt" and columns).
        tokenizer: encodes the prompts (once, at construction).
        max_prompt_len: longest prompt allowed (a longer one is refused with its index).
        prompts_per_step: prompts per step over every data-parallel rank.
        seed: the order's seed.
    """

    def __init__(self, records, tokenizer, *, max_prompt_len: int, prompts_per_step: int,
                 seed: int, source: str = "data.prompts"):  # fmt: skip
        self.records, self.tokenizer = records, tokenizer
        self.ids = [encode_text(tokenizer, r["prompt"]) for r in records]
        for i, ids in enumerate(self.ids):
            if not ids:
                raise DataError(f"{source}: prompt {i} is empty after tokenization")
            if len(ids) > max_prompt_len:
                raise DataError(
                    f"{source}: prompt {i} has {len(ids)} tokens; data.seq_len minus "
                    f"grpo.max_new_tokens leaves {max_prompt_len}"
                )
        self.prompts_per_step, self.seed = prompts_per_step, seed
        self.rank, self.ranks = 0, 1
        self.position = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        self.seq_len = max_prompt_len

    def build(self, dims, accum: int) -> None:
        """Called by the trainer once the layout exists: this rank's share."""
        self.rank, self.ranks = dims.rank("dp"), dims.dp
        if self.prompts_per_step % self.ranks:
            raise DataError(
                f"{self.prompts_per_step} prompts per step do not split over {self.ranks} "
                "data-parallel ranks"
            )

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.records)))
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's prompt records of the next step, each with its token ids."""
        picked = self.peek()
        self.position += self.prompts_per_step
        return picked

    def peek(self, ahead: int = 0) -> list[dict[str, Any]]:
        """What `next_step` will return after `ahead` more calls, without moving on (an
        asynchronous rollout samples them while earlier steps train)."""
        per_rank = self.prompts_per_step // self.ranks
        picked = []
        for k in range(self.rank * per_rank, (self.rank + 1) * per_rank):
            index = self.position + ahead * self.prompts_per_step + k
            epoch, offset = divmod(index, len(self.records))
            i = self._order(epoch)[offset]
            picked.append({**self.records[i], "prompt_ids": self.ids[i]})
        return picked

    def validation(self):
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])
