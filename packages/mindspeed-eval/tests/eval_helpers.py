"""Tiny models and data for the eval tests: a random Llama saved as a Hugging Face folder
with a byte-level BPE tokenizer trained here (BOS added by its post-processor, as Llama's),
and MMLU-style CSV folders."""

import csv
import json
import random
from pathlib import Path

from mindspeed_core.testing import import_sibling

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "was",
    "what",
    "which",
    "who",
    "answer",
    "question",
    "true",
    "false",
    "yes",
    "no",
    "red",
    "blue",
    "green",
    "apple",
    "river",
    "stone",
    "seven",
    "eight",
    "nine",
    "plus",
    "minus",
    "equals",
    "number",
    "city",
    "country",
    "capital",
    "water",
    "fire",
    "earth",
    "king",
    "queen",
    "small",
    "large",
    "old",
    "new",
    "first",
    "last",
    "because",
    "therefore",
]


def corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = rng.choices(WORDS, k=rng.randint(4, 14))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    lines += ["A. B. C. D.\nAnswer: A\nAnswer: B\nAnswer: C\nAnswer: D", "0 1 2 3 4 5 6 7 8 9"]
    return lines


def save_tokenizer(folder: Path, vocab_size: int = 400) -> None:
    """A byte-level BPE tokenizer.json (any text round-trips) whose post-processor adds
    <s>, with tokenizer_config.json naming the special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_model_dir(folder: Path, case: str = "llama", **changes) -> Path:
    """A random tiny `case` model (mindspeed-llm's test configs) with our tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = models_hf.make_hf(case, bos_token_id=0, eos_token_id=1, pad_token_id=3, **changes)
    hf.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def write_mmlu(folder: Path, subjects=("anatomy", "world_facts"), num_test=6, num_dev=3, seed=0):
    """MMLU's layout: test/{subject}_test.csv and dev/{subject}_dev.csv, no header."""
    rng = random.Random(seed)
    for split, count in (("test", num_test), ("dev", num_dev)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        for subject in subjects:
            with open(folder / split / f"{subject}_{split}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                for _ in range(count):
                    question = " ".join(rng.choices(WORDS, k=rng.randint(3, 9))).capitalize() + "?"
                    options = [" ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in "ABCD"]
                    writer.writerow([question, *options, rng.choice("ABCD")])
    return folder
