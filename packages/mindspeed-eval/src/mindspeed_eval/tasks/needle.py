"""Needle in a haystack: can the model find one fact in a long context?

A four-digit number is stated once ("The secret number is 4821.") at a chosen depth of
generated filler text (plain sentences about weather, gardens and trains); the prompt ends
by asking for it, and the model's first number in its greedy answer is graded. Each cell of
the grid (context length in tokens x depth in percent of the context) holds `per_cell`
haystacks; the subjects are the cells, so the table reads as accuracy per length and depth.
Everything is generated here (a fixed seed): no files, no network.

Use it to check a model after context extension (RoPE scaling, long-sequence training under
context parallel): a model that reads its whole context scores near 1.0 in every cell; one
that lost the far past fails at shallow depths first.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from mindspeed_core.errors import ConfigError
from mindspeed_eval.tasks.base import Item, Task

SEED = 20261126
QUESTION = "\nQuestion: What is the secret number? Answer: The secret number is"
_SUBJECTS = ("the weather", "the old garden", "the morning train", "the small harbour",
             "the village market", "the river", "the mountain path", "the library")  # fmt: skip
_PREDICATES = ("was quiet for most of the day", "changed slowly as the hours went by",
               "looked much as it had the year before", "was visited by a few people",
               "seemed calm and ordinary", "was described in a short letter",
               "had not changed in a long time", "was mentioned again at dinner")  # fmt: skip


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    """`count` plain sentences with no numbers in them."""
    return [f" {rng.choice(_SUBJECTS).capitalize()} {rng.choice(_PREDICATES)}."
            for _ in range(count)]  # fmt: skip


class NeedleTask(Task):
    """Args:
    lengths: context lengths in tokens (each prompt is within one sentence of it).
    depths: where the needle sits, in percent of the filler (0: first, 100: last).
    per_cell: haystacks per (length, depth).
    count_tokens: the model's token count of a text (set by `mindspeed eval` from the
        model's tokenizer before `load`).
    """

    name = "needle"
    layout = "nothing: the haystacks are generated (--context-lengths, --depths)"
    modes = ("direct",)
    until = ("\n", ".")
    max_gen_toks = 8

    def __init__(
        self,
        lengths: Sequence[int] = (256, 512, 1024),
        depths: Sequence[int] = (0, 25, 50, 75, 100),
        per_cell: int = 2,
        count_tokens: Callable[[str], int] | None = None,
    ):
        if not lengths or any(n < 32 for n in lengths):
            raise ConfigError(f"--context-lengths must be token counts >= 32, got {list(lengths)}")
        if not depths or any(not 0 <= d <= 100 for d in depths):
            raise ConfigError(f"--depths must be percentages in [0, 100], got {list(depths)}")
        self.lengths, self.depths, self.per_cell = list(lengths), list(depths), per_cell
        self.count_tokens = count_tokens or (lambda text: len(text.split()))

    def load(self, data: Path | None, *, shots: int, fewshot: dict | None) -> list[Item]:
        rng = random.Random(SEED)
        pool = filler_sentences(rng, 64)
        empty = self.count_tokens("")  # a BOS the model's encoding adds, if any
        sizes = [self.count_tokens(s) - empty for s in pool]
        # Sentences alone count a few more tokens than inside a text (a word-start piece each):
        # scale their sizes by what the whole pool counts, so haystacks fill their length.
        ratio = (self.count_tokens("".join(pool)) - empty) / sum(sizes)
        sizes = [size * ratio for size in sizes]
        items = []
        for length in self.lengths:
            for depth in self.depths:
                for _ in range(self.per_cell):
                    items.append(self._haystack(rng, pool, sizes, length, depth))
        return items

    def _haystack(self, rng, pool, sizes, length: int, depth: int) -> Item:
        number = rng.randint(1000, 9999)
        needle = f" The secret number is {number}."
        budget = length - self.count_tokens(needle) - self.count_tokens(QUESTION)
        chosen, used = [], 0
        shortest = min(range(len(pool)), key=sizes.__getitem__)
        while True:
            i = rng.randrange(len(pool))
            if used + sizes[i] > budget:  # the shortest sentence may still fit
                i = shortest
                if used + sizes[i] > budget:
                    break
            chosen.append(pool[i])
            used += sizes[i]
        while True:  # the parts' counts add up only nearly: trim to the exact length
            at = round(len(chosen) * depth / 100)
            prompt = ("".join(chosen[:at]) + needle + "".join(chosen[at:])).lstrip() + QUESTION
            if self.count_tokens(prompt) <= length or not chosen:
                break
            chosen.pop()
        return Item(
            subject=f"{length:>6} tokens, depth {depth:>3}%",
            prompt=prompt,
            target=str(number),
            meta={"length": length, "depth": depth, "tokens": self.count_tokens(prompt)},
        )

    def answer(self, item: Item, text: str) -> str:
        found = re.search(r"\d+", text)
        return found.group(0) if found else text.strip()

    def grade(self, items: list[Item], outputs: list[str]) -> list[dict]:
        return [
            {"answer": a, "correct": a == item.target, "length": item.meta["length"],
             "depth": item.meta["depth"], "tokens": item.meta["tokens"]}
            for item, a in zip(items, outputs, strict=True)
        ]  # fmt: skip

    def summary(self, grades: list[dict]) -> dict[str, float]:
        """Accuracy per context length and per depth (the grid's margins)."""
        metrics = {}
        for key, values in (("length", self.lengths), ("depth", self.depths)):
            for value in values:
                cell = [g for g in grades if g.get(key) == value]
                if cell:
                    metrics[f"accuracy@{key}={value}"] = sum(g["correct"] for g in cell) / len(cell)
        return metrics
