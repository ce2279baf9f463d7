"""Run one benchmark: items -> prompts in a mode -> scores or generations -> grades.

Under torchrun each data-parallel group (see `loading.EvalMesh`) takes every dp_size-th
item; grades are gathered on every rank and ordered back, so rank 0 reports the whole set.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from mindspeed_core.errors import ConfigError
from mindspeed_eval.scorer import Scorer
from mindspeed_eval.tasks import Item, Task


@dataclass(kw_only=True)
class RunOptions:
    """How a benchmark is run."""

    mode: str | None = None
    """"ppl", "direct" or "chat" (None: the task's default)."""
    samples: int = 1
    """Generations per item (HumanEval pass@k); > 1 samples with `temperature`."""
    temperature: float = 0.0
    """0 greedy; > 0 samples (default 0.8 when samples > 1)."""
    seed: int = 1234
    """Sampling seed."""
    max_gen_toks: int | None = None
    """New tokens per generated answer (None: the task's own limit)."""
    progress: bool = True


@dataclass
class TaskResult:
    """Per-item grades and their summary."""

    task: str
    mode: str
    grades: list[dict]
    subjects: dict[str, dict[str, float]] = field(default_factory=dict)
    """subject -> {"n": count, "correct": count, "accuracy": fraction}."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Overall: accuracy (micro average over items) and task-specific ones (pass@k)."""


def run_task(task: Task, items: list[Item], scorer: Scorer, options: RunOptions) -> TaskResult:
    """Grade `items` of `task` with `scorer` (see the module docstring)."""
    mode = options.mode or task.modes[0]
    if mode not in task.modes:
        raise ConfigError(f"task {task.name} supports modes {', '.join(task.modes)}, not {mode!r}")
    if options.samples > 1:
        items = [item for item in items for _ in range(options.samples)]
    mesh = scorer.mesh
    mine = list(range(mesh.dp_rank, len(items), mesh.dp_size))
    grades = _grade(task, [items[i] for i in mine], scorer, mode, options)
    if mesh.dp_size > 1:
        grades = _gather(mine, grades, len(items))
    for item, grade in zip(items, grades, strict=True):
        grade["subject"] = item.subject
    return summarise(task, mode, grades)


def _grade(
    task: Task, items: list[Item], scorer: Scorer, mode: str, options: RunOptions
) -> list[dict]:
    grades: list[dict | None] = [None] * len(items)
    scored = [i for i, item in enumerate(items) if mode == "ppl" and item.choices]
    if scored:
        pairs = [(items[i].prompt, choice) for i in scored for choice in items[i].choices]
        lls = iter(scorer.loglikelihood(pairs, progress=options.progress and scorer.mesh.is_main))
        for i in scored:
            scores = [next(lls)[0] for _ in items[i].choices]
            answer = items[i].label(max(range(len(scores)), key=scores.__getitem__))
            grades[i] = {
                "answer": answer,
                "correct": answer == items[i].target,
                "loglikelihoods": scores,
            }
    generated = [i for i in range(len(items)) if grades[i] is None]
    if generated:
        texts = _generate(task, [items[i] for i in generated], scorer, mode, options)
        answers = [task.answer(items[i], t) for i, t in zip(generated, texts, strict=True)]
        for i, grade, text in zip(
            generated, task.grade([items[i] for i in generated], answers), texts, strict=True
        ):
            grades[i] = {**grade, "output": text}
    return grades


def _generate(
    task: Task, items: list[Item], scorer: Scorer, mode: str, options: RunOptions
) -> list[str]:
    if mode == "chat":
        prompts = [
            scorer.apply_chat_template(item.messages or [{"role": "user", "content": item.prompt}])
            for item in items
        ]
    else:
        prompts = [item.prompt for item in items]
    temperature = options.temperature or (0.8 if options.samples > 1 else 0.0)
    return scorer.generate_until(
        prompts,
        until=task.until,
        max_gen_toks=min(options.max_gen_toks or task.max_gen_toks, scorer.max_length - 1),
        temperature=temperature,
        seed=options.seed if temperature else None,
        progress=options.progress and scorer.mesh.is_main,
    )


def _gather(mine: list[int], grades: list[dict], total: int) -> list[dict]:
    """Every group's grades, in item order (the tp ranks of a group hold the same ones)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(zip(mine, grades, strict=True)))
    merged: dict[int, dict] = {}
    for part in parts:
        merged.update(part)
    assert len(merged) == total, (len(merged), total)
    return [merged[i] for i in range(total)]


def summarise(task: Task, mode: str, grades: list[dict]) -> TaskResult:
    """Per-subject and overall accuracy (plus the task's own metrics)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for grade in grades:
        counts[grade["subject"]][0] += 1
        counts[grade["subject"]][1] += bool(grade["correct"])
    subjects = {
        name: {"n": n, "correct": c, "accuracy": c / n} for name, (n, c) in sorted(counts.items())
    }
    total = len(grades)
    metrics = {"accuracy": sum(bool(g["correct"]) for g in grades) / total if total else 0.0}
    if total and all("loglikelihoods" in g for g in grades):  # guessing among the choices
        metrics["chance"] = sum(1 / len(g["loglikelihoods"]) for g in grades) / total
    summary = getattr(task, "summary", None)
    if summary is not None and grades:
        metrics.update(summary(grades))
    return TaskResult(task.name, mode, grades, subjects, metrics)
