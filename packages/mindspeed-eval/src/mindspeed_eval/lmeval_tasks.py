"""lm-eval on local files: `mindspeed eval --task lm-eval:NAME`, and lm-eval task configs
that ask exactly what our MMLU runner asks (the oracle of its tests, and a way to compare).

lm-eval ships no evaluation data: its built-in tasks download from the Hugging Face Hub.
Offline, NAME must be a task whose data is local: a task YAML in the `--data` folder
(`dataset_path: json|csv` with `data_files`, see lm-eval's "Using Local Datasets") or a
built-in task whose dataset is already in the local Hugging Face cache. The Hub stays off
(HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) unless the caller's environment says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_eval.scorer import Scorer
from mindspeed_eval.tasks.base import read_csv, split_folder, subject_of
from mindspeed_eval.tasks.choice import MMLU, MMLU_COLUMNS

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}


def mmlu_task_configs(data: Path, shots: int = 5) -> list[dict[str, Any]]:
    """One lm-eval task config per subject of an MMLU folder (our layout), whose contexts
    and choices are those of `MMLU` in `ppl` mode: the n-shot text as the description,
    the question with its options, and " A".." D" scored after "Answer:"."""
    runner = MMLU()
    folder = split_folder(data, runner.split, runner.suffix)
    configs = []
    for path in sorted(folder.glob(f"*{runner.suffix}")):
        subject = subject_of(path)
        dev = runner._dev(folder, subject, shots)
        configs.append(
            {
                "task": f"mindspeed_mmlu_{subject}",
                "dataset_path": "csv",
                "dataset_kwargs": {
                    "data_files": {"test": str(path.resolve())},
                    "column_names": list(MMLU_COLUMNS),
                    "keep_default_na": False,
                },
                "test_split": "test",
                "output_type": "multiple_choice",
                "description": runner.shots(subject, dev) + "\n\n",
                "doc_to_text": "{{question}}\nA. {{A}}\nB. {{B}}\nC. {{C}}\nD. {{D}}\nAnswer:",
                "doc_to_choice": ["A", "B", "C", "D"],
                "doc_to_target": "{{['A', 'B', 'C', 'D'].index(answer.strip())}}",
                "target_delimiter": " ",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            }
        )
    if not configs:
        raise DataError(f"{data}: no *{runner.suffix} files for the MMLU task configs")
    read_csv(next(folder.glob(f"*{runner.suffix}")), MMLU_COLUMNS, header=False)  # layout check
    return configs


def run_lm_eval(
    scorer: Scorer,
    name: str,
    *,
    include: Path | None,
    num_fewshot: int | None,
    limit: int | None,
    apply_chat_template: bool,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` for task `name` with our model; returns its results."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager

        from mindspeed_eval.lm import MindSpeedLM
    except ImportError:
        raise ConfigError(
            "--task lm-eval:NAME needs lm-eval: pip install 'mindspeed-eval[lm-eval]'"
        ) from None
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    if include is not None and not include.is_dir():
        raise ConfigError(f"--data {include} is not a folder of lm-eval task YAML files")
    manager = None
    if include is not None:  # local tasks first: indexing lm-eval's ~14k built-in files is slow
        manager = TaskManager(include_path=str(include), include_defaults=False)
    if manager is None or name not in manager.all_tasks:
        manager = TaskManager(include_path=str(include) if include else None)
    if name not in manager.all_tasks:
        raise ConfigError(
            f"lm-eval has no task {name!r}"
            + (f" (nor does {include})" if include else " (give local task YAML with --data DIR)")
        )
    try:
        return lm_eval.simple_evaluate(
            model=MindSpeedLM(scorer=scorer),
            tasks=[name],
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            apply_chat_template=apply_chat_template,
        )
    except (FileNotFoundError, ConnectionError) as err:
        raise DataError(f"lm-eval task {name!r} could not load its data offline: {err}") from None
