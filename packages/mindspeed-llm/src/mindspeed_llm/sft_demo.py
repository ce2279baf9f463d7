"""The embedded SFT demo: a tiny model learns to answer counting questions.

Questions in the words of the pretraining demo corpus ("alice had three cups and bob had
two. how many cups did they have together?") with the answer as one number word
("five"). The task, a held-out set (questions never seen in training) and a one-line chat
template for the demo's sentencepiece tokenizer are generated once and cached next to
the demo corpus. `exact_match` greedy-decodes the answers and counts the right ones.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from mindspeed_core.distributed import is_rank0
from mindspeed_core.files import staged_folder
from mindspeed_llm.demo import NAMES, NUMBER_WORDS, THINGS, cache_root, ensure_demo_data

DEMO_VERSION = "v1"
NUM_TRAIN = 4000
NUM_HELDOUT = 200
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'question: ' + message['content'] + ' answer:' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + '</s>' }}"
    "{% endif %}{% endfor %}"
)
"""The demo's chat format: `question: ... answer:` then the reply and `</s>`."""


@dataclass(frozen=True)
class SFTDemo:
    train: Path
    heldout: Path
    template: Path
    tokenizer: Path


def _question(rng: random.Random) -> dict[str, str]:
    a, b = rng.sample(NAMES, 2)
    thing, x, y = rng.choice(THINGS), rng.randint(0, 5), rng.randint(0, 5)
    question = (f"{a} had {NUMBER_WORDS[x]} {thing} and {b} had {NUMBER_WORDS[y]}. "
                f"how many {thing} did they have together?")  # fmt: skip
    return {"instruction": question, "output": NUMBER_WORDS[x + y]}


def demo_task(num: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [_question(rng) for _ in range(num)]


def ensure_sft_demo(root: Path | None = None) -> SFTDemo:
    """The demo's files, built on first use (call on one rank)."""
    root = root or cache_root()
    tokenizer = ensure_demo_data(root).tokenizer
    folder = root / f"sft-demo-{DEMO_VERSION}"
    demo = SFTDemo(folder / "train.jsonl", folder / "heldout.jsonl", folder / "template.jinja",
                   tokenizer)  # fmt: skip
    if demo.heldout.is_file():
        return demo
    with staged_folder(folder) as staging:  # all or nothing
        train = demo_task(NUM_TRAIN, seed=1)
        seen = {r["instruction"] for r in train}
        heldout = [r for r in demo_task(4 * NUM_HELDOUT, seed=2) if r["instruction"] not in seen]
        for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout[:NUM_HELDOUT])):
            (staging / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (staging / "template.jinja").write_text(TEMPLATE)
    return demo


def use_demo_data(cfg) -> SFTDemo:
    """Point `cfg.data` at the demo task (built on rank 0 first)."""
    if is_rank0():
        ensure_sft_demo()
    if dist.is_initialized():
        dist.barrier()
    demo = ensure_sft_demo()
    cfg.data.paths = [str(demo.train)]
    cfg.data.handler = "alpaca"
    cfg.data.tokenizer = cfg.data.tokenizer or demo.tokenizer
    cfg.data.chat_template = cfg.data.chat_template or str(demo.template)
    return demo


def exact_match(model, tokenizer, template, records: list[dict[str, str]], batch: int = 50) -> float:
    """The fraction of `records` (alpaca instruction/output) whose greedy answer, up to
    the end-of-sequence token, is exactly the output."""
    import torch

    from mindspeed_llm.chat_template import encode_text
    from mindspeed_llm.generation import GenerationConfig, generate

    stops = tuple(i for i in (tokenizer.eod_id,) if i is not None)
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=stops)
    right = 0
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(records), batch):
            chunk = records[start : start + batch]
            prompts = [encode_text(tokenizer, template.render(
                [{"role": "user", "content": r["instruction"]}], add_generation_prompt=True))
                for r in chunk]  # fmt: skip
            with torch.no_grad():
                outputs = generate(model, prompts, config)
            for record, out in zip(chunk, outputs, strict=True):
                text = tokenizer.decode([t for t in out if t not in stops]).strip()
                right += text == record["output"]
    finally:
        model.train(was_training)
    return right / max(1, len(records))
