"""Free-form benchmarks on MindSpeed-LLM's local layouts: BBH and GSM8K (generation only)."""

from __future__ import annotations

import re
from pathlib import Path

from mindspeed_eval.tasks.base import Item, Task, read_json, read_jsonl, subject_of


class BBH(Task):
    """BIG-Bench Hard: `{task}.json` files holding {"examples": [{"input", "target"}]}.

    Shots come from a MindSpeed-LLM `bbh_template.json` ({task: text}) when given
    (`--fewshot-template`), else the prompt is zero-shot."""

    name = "bbh"
    layout = '{task}.json files holding {"examples": [{"input": ..., "target": ...}]}'
    modes = ("direct", "chat")
    until = ("\n\n", "\nQ:")
    max_gen_toks = 32

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        files = sorted(p for p in data.glob("*.json") if not p.name.endswith("template.json"))
        if not files:
            raise self.missing(data, "no {task}.json files")
        items = []
        for path in files:
            subject = subject_of(path)
            content = read_json(path)
            examples = content.get("examples") if isinstance(content, dict) else None
            if not isinstance(examples, list):
                raise self.missing(path, 'no "examples" list')
            shot = (fewshot or {}).get(subject, "")
            for number, example in enumerate(examples):
                if not isinstance(example, dict) or not {"input", "target"} <= example.keys():
                    raise self.missing(path, f'example {number} lacks "input" or "target"')
                items.append(
                    Item(
                        subject=subject,
                        prompt=f"{shot}Q: {example['input']}\nA:",
                        target=str(example["target"]).strip().lstrip("(").rstrip(")"),
                    )
                )
        return items

    def answer(self, item: Item, text: str) -> str:
        first = (text.strip().splitlines() or [""])[0].strip()
        return first.lstrip("(").rstrip(").").strip()

    def grade(self, items: list[Item], outputs: list[str]) -> list[dict]:
        return [
            {"answer": a, "correct": a.lower() == item.target.lower()}
            for item, a in zip(items, outputs, strict=True)
        ]


class GSM8K(Task):
    """GSM8K: `*.jsonl` test files with question and answer ("... #### 42"); shots from
    `train.jsonl` next to them (or a MindSpeed-LLM `{"few_shot": text}` template)."""

    name = "gsm8k"
    layout = "*.jsonl files with question and answer ('... #### 42') per line (train.jsonl: shots)"
    modes = ("direct", "chat")
    default_shots = 3
    until = ("\n\nQ:", "\nQ:")
    max_gen_toks = 256

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        files = sorted(p for p in data.glob("*.jsonl") if "train" not in p.name)
        if not files:
            raise self.missing(data, "no test *.jsonl files")
        shot = self._shots(data, shots, fewshot)
        items = []
        for path in files:
            for row in read_jsonl(path, ("question", "answer")):
                prompt = (
                    f"{shot}\n\nQ: {row['question']}\n\nA:"
                    if shot
                    else f"Q: {row['question']}\n\nA:"
                )
                items.append(
                    Item(
                        subject=subject_of(path),
                        prompt=prompt,
                        target=_number(str(row["answer"]).split("####")[-1]),
                    )
                )
        return items

    def _shots(self, data: Path, shots: int, fewshot: dict | None) -> str:
        if fewshot and "few_shot" in fewshot:
            return fewshot["few_shot"]
        train = data / "train.jsonl"
        if shots == 0 or not train.is_file():
            return ""
        rows = read_jsonl(train, ("question", "answer"))[:shots]
        return "\n\n".join(f"Q: {r['question']}\n\nA:{_solution(r['answer'])}" for r in rows)

    def answer(self, item: Item, text: str) -> str:
        stated = re.search(r"The answer is\s*\$?(-?[\d,]*\.?\d+)", text)
        if stated:
            return _number(stated.group(1))
        numbers = re.findall(r"-?[\d,]*\.?\d+", text)
        return _number(numbers[-1]) if numbers else ""


def _solution(answer: str) -> str:
    """A training answer as the shots show it: the reasoning, then "The answer is N."."""
    reasoning, _, final = answer.rpartition("####")
    return f"{reasoning.strip()} The answer is {_number(final)}."


def _number(text: str) -> str:
    value = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number == int(number) else str(number)
