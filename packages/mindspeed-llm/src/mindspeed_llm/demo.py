"""The embedded demo corpus: a small synthetic language MindSpeed makes itself.

Short stories about people, things and counts, drawn from templates with a
fixed seed: a model that learns the templates (which word follows which, that
``3 plus 4`` is ``7``, that a name comes back later in a story) drives its loss far
below the ~6.2 nats of guessing among 512 tokens. Built once (a few seconds),
with a sentencepiece tokenizer trained on it, and cached under
``$MINDSPEED_CACHE`` (default ``~/.cache/mindspeed``).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from mindspeed_core.files import staged_folder

DEMO_VERSION = "v1"
VOCAB_SIZE = 512
NUM_DOCUMENTS = 12000
PREFIX = "demo_text_document"

# The demo language's words: public, since the other commands' demos (SFT, DPO, PRM, RL,
# eval) ask questions in the same language the pretraining demo teaches.
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
THINGS = ["apples", "books", "coins", "stones", "shells", "cards", "pens", "cups"]
PLACES = ["garden", "kitchen", "market", "library", "harbor", "forest", "school"]
COLORS = ["red", "blue", "green", "yellow", "white", "black"]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]


@dataclass(frozen=True)
class DemoData:
    tokenizer: Path
    prefix: Path


def cache_root() -> Path:
    return Path(os.environ.get("MINDSPEED_CACHE", Path.home() / ".cache" / "mindspeed"))


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing, place, color = rng.choice(THINGS), rng.choice(PLACES), rng.choice(COLORS)
    x, y = rng.randint(0, 5), rng.randint(0, 5)
    lines = [
        f"{a} went to the {place} with {b}.",
        f"{a} had {NUMBER_WORDS[x]} {color} {thing} and {b} had {NUMBER_WORDS[y]}.",
        f"{x} plus {y} is {x + y}, so together they had {NUMBER_WORDS[x + y]} {thing}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"then {b} gave the {thing} to {a}, and {a} said thank you to {b}.")
    else:
        lines.append(f"then {a} and {b} walked home from the {place}.")
    return " ".join(lines)


def demo_texts(num_documents: int = NUM_DOCUMENTS, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_story(rng) for _ in range(num_documents)]


def ensure_demo_data(root: Path | None = None) -> DemoData:
    """The demo tokenizer and indexed dataset, built on first use (call on one rank)."""
    folder = (root or cache_root()) / f"demo-{DEMO_VERSION}"
    data = DemoData(folder / "tokenizer.model", folder / PREFIX)
    if data.tokenizer.is_file() and Path(f"{data.prefix}.idx").is_file():
        return data
    with staged_folder(folder) as staging:  # all or nothing
        _build(staging)
    return data


def _build(folder: Path) -> None:
    from mindspeed_llm.data import IndexedDatasetWriter, best_dtype
    from mindspeed_llm.tokenizer import load_tokenizer, train_sentencepiece

    texts = demo_texts()
    model = train_sentencepiece(texts, folder / "tokenizer", VOCAB_SIZE)
    tokenizer = load_tokenizer(model)
    with IndexedDatasetWriter(folder / PREFIX, best_dtype(tokenizer.vocab_size)) as writer:
        for text in texts:
            writer.add_document(tokenizer.encode(text) + [tokenizer.eod_id])
