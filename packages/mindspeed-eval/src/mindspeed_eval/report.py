"""Results as a table on the terminal, a results JSON and a markdown summary."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mindspeed_eval.runner import TaskResult


def table(result: TaskResult) -> str:
    """Per-subject accuracy, then the overall numbers, as fixed-width text."""
    width = max([len("subject"), *(len(s) for s in result.subjects)])
    lines = [f"{'subject':<{width}}  {'n':>6}  {'correct':>7}  {'accuracy':>8}"]
    lines.append("-" * len(lines[0]))
    for name, row in result.subjects.items():
        lines.append(
            f"{name:<{width}}  {row['n']:>6}  {row['correct']:>7}  {row['accuracy']:>8.4f}"
        )
    lines.append("-" * len(lines[0]))
    n = sum(r["n"] for r in result.subjects.values())
    correct = sum(r["correct"] for r in result.subjects.values())
    lines.append(f"{'all':<{width}}  {n:>6}  {correct:>7}  {result.metrics['accuracy']:>8.4f}")
    extra = {k: v for k, v in result.metrics.items() if k != "accuracy"}
    lines += [f"{name}: {value:.4f}" for name, value in extra.items()]
    return "\n".join(lines)


def markdown(result: TaskResult, header: dict[str, Any]) -> str:
    lines = [f"# {result.task} ({result.mode})", ""]
    lines += [f"- {key}: `{value}`" for key, value in header.items()]
    lines += ["", "| subject | n | correct | accuracy |", "|---|---:|---:|---:|"]
    for name, row in result.subjects.items():
        lines.append(f"| {name} | {row['n']} | {row['correct']} | {row['accuracy']:.4f} |")
    lines.append("")
    lines += [f"**{name}: {value:.4f}**  " for name, value in result.metrics.items()]
    return "\n".join(lines) + "\n"


def results_json(result: TaskResult, header: dict[str, Any]) -> dict[str, Any]:
    return {
        **header,
        "task": result.task,
        "mode": result.mode,
        "metrics": result.metrics,
        "subjects": result.subjects,
        "items": result.grades,
    }


def write_outputs(folder: Path, result: TaskResult, header: dict[str, Any]) -> list[Path]:
    """`{task}_results.json` and `{task}_summary.md` in `folder`, each appearing whole."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (
        (
            f"{result.task}_results.json",
            json.dumps(results_json(result, header), indent=1, ensure_ascii=False),
        ),
        (f"{result.task}_summary.md", markdown(result, header)),
    ):
        written.append(atomic_write(folder / name, text))
    return written


def atomic_write(target: Path, text: str) -> Path:
    """Write `text` to `target` through a temporary file renamed onto it."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target
