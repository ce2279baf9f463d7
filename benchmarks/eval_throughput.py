"""Evaluation speed: our lm-eval model (`mindspeed`) against lm-eval's own Hugging Face
backend (`HFLM`), same weights, same local task, same harness.

    python benchmarks/eval_throughput.py [--items 100] [--shots 5] [--batch-size 8] [--threads N]

A random Llama (the training benchmark's headline size: vocab 32000, hidden 512, 4
layers) is saved as a Hugging Face folder with a small byte-level BPE tokenizer, and
converted to our checkpoint format with `mindspeed convert`'s function. A local MMLU
folder (headerless CSVs, `--items` test questions over 4 subjects, n-shot from dev) goes
through lm-eval's `simple_evaluate` twice with the task configs of
`mindspeed_eval.lmeval_tasks.mmlu_task_configs`: once with `MindSpeedLM` on the converted
checkpoint, once with `HFLM` (transformers, fp32, the same batch size) on the HF folder.
Both must give the same accuracy. Reported: items/s of each (wall clock and this
process's CPU time, which is steadier on a shared machine) and their ratio. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from train_throughput import HEADLINE

from mindspeed_core.testing import import_sibling

TESTS = Path(__file__).resolve().parents[1] / "packages" / "mindspeed-eval" / "tests"


def _setup(root: Path, items: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_tools.convert import hf_to_mindspeed

    helpers = import_sibling(str(TESTS / "conftest.py"), "eval_helpers")
    torch.manual_seed(0)
    config = {k: v for k, v in HEADLINE.items() if k != "model_type"}
    hf_dir = root / "hf"
    LlamaForCausalLM(LlamaConfig(**config, bos_token_id=0, eos_token_id=1)).save_pretrained(hf_dir)
    helpers.save_tokenizer(hf_dir)
    converted = hf_to_mindspeed(hf_dir, root / "converted")
    subjects = ("anatomy", "astronomy", "history", "law")
    data = helpers.write_mmlu(root / "mmlu", subjects, num_test=items // len(subjects), num_dev=5)
    return hf_dir, converted, data


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from mindspeed_eval.lm import MindSpeedLM
    from mindspeed_eval.lmeval_tasks import mmlu_task_configs

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, converted, data = _setup(Path(tmp), args.items)
        tasks = mmlu_task_configs(data, shots=args.shots)
        ours = MindSpeedLM(model=str(converted), batch_size=args.batch_size)
        theirs = HFLM(
            pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=args.batch_size
        )
        manager = TaskManager()  # indexing lm-eval's ~14k task files once, outside the timing
        results = {}
        for name, lm in (("hflm", theirs), ("ours", ours)):
            run = lambda lm=lm, **kw: lm_eval.simple_evaluate(model=lm, task_manager=manager, **kw)  # noqa: E731
            run(tasks=tasks[:1], limit=4)  # warm-up
            out, wall, cpu = _timed(lambda run=run: run(tasks=tasks))
            n = sum(v["original"] for v in out["n-samples"].values())
            accs = {k: v["acc,none"] for k, v in sorted(out["results"].items())}
            results[name] = {"items": n, "wall_s": wall, "cpu_s": cpu, "acc": accs}
    assert results["ours"]["acc"] == results["hflm"]["acc"], results
    row = {
        "benchmark": "eval_throughput",
        "task": f"local MMLU CSV, {args.shots}-shot, loglikelihood",
        "model": "llama vocab 32000 hidden 512 x4 layers, fp32",
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "items": results["ours"]["items"],
    }
    for name, r in results.items():
        row[f"{name}_items_per_s"] = round(r["items"] / r["wall_s"], 3)
        row[f"{name}_items_per_cpu_s"] = round(r["items"] / r["cpu_s"], 3)
    row["ratio_wall"] = round(row["ours_items_per_s"] / row["hflm_items_per_s"], 2)
    row["ratio_cpu"] = round(row["ours_items_per_cpu_s"] / row["hflm_items_per_cpu_s"], 2)
    row["goal"] = ">= 1.5x lm-eval HF on CPU"
    row["goal_met"] = row["ratio_wall"] >= 1.5
    print(json.dumps(row))


if __name__ == "__main__":
    main()
