"""The embedded task: multiple-choice questions about the pretrain demo's stories.

`mindspeed pretrain` with no arguments trains on short generated stories
(`mindspeed_llm.demo`): who went where with whom, how many things each had, their sum.
These questions are new stories of the same kind (another seed), each asking for what the
language of the stories fixes, among four candidates (chance: 25%):

- ``sum``:      "... 3 plus 4 is" -> " 7"
- ``together``: "... so together they had" -> " seven"
- ``thanks``:   "... then bob gave the cups to alice, and alice said thank you to" -> " bob"
"""

from __future__ import annotations

import random
from pathlib import Path

from mindspeed_eval.tasks.base import Item, Task

SEED = 20240601
NUM_PER_SUBJECT = 40


class DemoTask(Task):
    name = "demo"
    layout = "nothing: the questions are generated"
    modes = ("ppl",)

    def load(self, data: Path | None, *, shots: int, fewshot: dict | None) -> list[Item]:
        from mindspeed_llm.demo import COLORS, NAMES, NUMBER_WORDS, PLACES, THINGS

        rng = random.Random(SEED)
        items = []
        for subject in ("sum", "together", "thanks"):
            for _ in range(NUM_PER_SUBJECT):
                a, b = rng.sample(NAMES, 2)
                thing, place, color = rng.choice(THINGS), rng.choice(PLACES), rng.choice(COLORS)
                x, y = rng.randint(0, 5), rng.randint(0, 5)
                story = (
                    f"{a} went to the {place} with {b}. "
                    f"{a} had {NUMBER_WORDS[x]} {color} {thing} and {b} had {NUMBER_WORDS[y]}."
                )
                if subject == "sum":
                    prompt, right, pool = (
                        f"{story} {x} plus {y} is",
                        str(x + y),
                        [str(i) for i in range(11)],
                    )
                elif subject == "together":
                    prompt = f"{story} {x} plus {y} is {x + y}, so together they had"
                    right, pool = NUMBER_WORDS[x + y], list(NUMBER_WORDS)
                else:
                    prompt = (
                        f"{story} {x} plus {y} is {x + y}, so together they had "
                        f"{NUMBER_WORDS[x + y]} {thing}. then {b} gave the {thing} to {a}, "
                        f"and {a} said thank you to"
                    )
                    right, pool = b, [n for n in NAMES if n != a]
                wrong = rng.sample([p for p in pool if p != right], 3)
                options = [right, *wrong]
                rng.shuffle(options)
                items.append(
                    Item(
                        subject=subject,
                        prompt=prompt,
                        target="ABCD"[options.index(right)],
                        choices=tuple(f" {o}" for o in options),
                    )
                )
        return items
