"""Benchmark runners on local files, by name (an explicit registry)."""

from __future__ import annotations

from mindspeed_core.errors import ConfigError
from mindspeed_eval.tasks.base import MODES, Item, Task
from mindspeed_eval.tasks.choice import MMLU, AGIEval, BoolQ, CEval
from mindspeed_eval.tasks.demo import DemoTask
from mindspeed_eval.tasks.generative import BBH, GSM8K
from mindspeed_eval.tasks.humaneval import HumanEval
from mindspeed_eval.tasks.needle import NeedleTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (MMLU, CEval, BoolQ, BBH, AGIEval, GSM8K, HumanEval, DemoTask, NeedleTask)
}
LM_EVAL_PREFIX = "lm-eval:"

__all__ = ["LM_EVAL_PREFIX", "MODES", "TASKS", "Item", "Task", "get_task"]


def get_task(name: str) -> Task:
    """The runner called `name`.

    Raises:
        ConfigError: no such task (the message lists the known ones).
    """
    if name not in TASKS:
        known = ", ".join(sorted(TASKS))
        raise ConfigError(
            f"unknown task {name!r}; known tasks: {known}, or {LM_EVAL_PREFIX}NAME for a task "
            "of lm-eval's registry"
        )
    return TASKS[name]()
