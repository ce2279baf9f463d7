"""HumanEval: complete Python functions, run them against their tests in the sandbox.

Data: `*.jsonl` with task_id, prompt, test and entry_point per line (the official
`HumanEval.jsonl` layout, as MindSpeed-LLM reads it). `direct` completes the prompt as
code (stops at the next top-level statement); `chat` asks through the chat template with
MindSpeed-LLM's instruction and takes the code block of the reply. Each program is the
prompt, the completion, the tests and `check(entry_point)`, run by
`mindspeed_eval.sandbox.run_program`. With n samples per task, pass@k is the unbiased
estimator of Chen et al. (2021).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mindspeed_eval.sandbox import SandboxLimits, run_program
from mindspeed_eval.tasks.base import Item, Task, read_jsonl

INSTRUCTION = (
    "The definition and function description of the python function are as follows. "
    "Please complete the implementation of the python function.\n{prompt}"
)
_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class HumanEval(Task):
    name = "humaneval"
    layout = "*.jsonl files with task_id, prompt, test and entry_point per line"
    modes = ("direct", "chat")
    until = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
    max_gen_toks = 384
    limits = SandboxLimits()

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        files = [data] if data.is_file() else sorted(data.glob("*.jsonl"))
        if not files:
            raise self.missing(data, "no *.jsonl files")
        items = []
        for path in files:
            for row in read_jsonl(path, ("task_id", "prompt", "test", "entry_point")):
                items.append(
                    Item(
                        subject="humaneval",
                        prompt=row["prompt"],
                        target="pass",
                        messages=[
                            {"role": "user", "content": INSTRUCTION.format(prompt=row["prompt"])}
                        ],
                        meta={k: row[k] for k in ("task_id", "test", "entry_point")},
                    )
                )
        return items

    def answer(self, item: Item, text: str) -> str:
        return text  # graded by running it

    def program(self, item: Item, completion: str) -> str:
        block = _CODE_BLOCK.search(completion)
        code = block.group(1) if block else completion
        entry = item.meta["entry_point"]
        body = code if re.search(rf"^def {re.escape(entry)}\b", code, re.M) else item.prompt + code
        return f"{body}\n\n{item.meta['test']}\n\ncheck({entry})\n"

    def grade(self, items: list[Item], outputs: list[str]) -> list[dict]:
        programs = [self.program(item, text) for item, text in zip(items, outputs, strict=True)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda p: run_program(p, self.limits), programs))
        return [
            {"answer": r.status, "correct": r.passed, "task_id": item.meta["task_id"]}
            for item, r in zip(items, results, strict=True)
        ]

    def summary(self, grades: list[dict]) -> dict[str, float]:
        """pass@k for each k up to the samples per task (1, 10, 100)."""
        per_task: dict[str, list[bool]] = defaultdict(list)
        for grade in grades:
            per_task[grade["task_id"]].append(grade["correct"])
        n = min(len(v) for v in per_task.values())
        return {
            f"pass@{k}": statistics.fmean(pass_at_k(len(v), sum(v), k) for v in per_task.values())
            for k in (1, 10, 100)
            if k <= n
        }
