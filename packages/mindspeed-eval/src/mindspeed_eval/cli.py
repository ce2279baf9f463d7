"""`mindspeed eval`: benchmark a model on local files.

    mindspeed eval                                     # the pretrain demo's model, demo task
    mindspeed eval --model DIR --task mmlu --data mmlu/ [--mode ppl|direct|chat] [--shots 5]
    mindspeed eval --model DIR --task humaneval --data he/ --allow-code-execution
    mindspeed eval --model DIR --task lm-eval:NAME --data yaml_dir/   # lm-eval's registry
    mindspeed eval --model DIR --task needle [--context-lengths 4096,16384] [--depths 0,50,100]
    torchrun --nproc-per-node 4 -m mindspeed_eval.cli --model DIR --task mmlu --data d --tp 2

Prints a per-subject table and writes `{task}_results.json` (every item's answer) and
`{task}_summary.md` to `--output` (default runs/eval).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from mindspeed_core.cli import ArgumentParser, Command, debug_enabled, guarded
from mindspeed_core.errors import CheckpointError, ConfigError, DataError
from mindspeed_core.files import check_folder
from mindspeed_eval.tasks import LM_EVAL_PREFIX, MODES, TASKS, get_task

DEMO_RUN = Path("runs/pretrain")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mindspeed eval", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help=f"HF folder, converted checkpoint or run checkpoints (default: {DEMO_RUN}/checkpoints)",
    )
    p.add_argument(
        "--task", default="demo", help=f"{', '.join(TASKS)} or {LM_EVAL_PREFIX}NAME (default: demo)"
    )
    p.add_argument("--data", help="the benchmark's local folder (lm-eval: a folder of task YAML)")
    p.add_argument(
        "--mode",
        choices=MODES,
        help="ppl: score choices; direct: n-shot + generate; chat: chat template + generate",
    )
    p.add_argument(
        "--shots", type=int, help="few-shot examples from the dev files (default: the task's)"
    )
    p.add_argument(
        "--fewshot-template", help="MindSpeed-LLM few-shot template JSON ({subject: text})"
    )
    p.add_argument("--limit", type=int, help="at most this many items per task (quick runs)")
    p.add_argument(
        "--context-lengths",
        help="needle: haystack lengths in tokens, comma-separated (default: 1/4, 1/2 and all "
        "of the model's context)",
    )
    p.add_argument(
        "--depths", help="needle: depths of the needle in percent (default: 0,25,50,75,100)"
    )
    p.add_argument("--output", default="runs/eval", help="folder for the results JSON and summary")
    p.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run generated code (humaneval) in the sandbox",
    )
    p.add_argument("--samples", type=int, default=1, help="generations per item (pass@k)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (0.8 when --samples > 1)"
    )
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument(
        "--max-gen-toks", type=int, help="new tokens per generated answer (default: the task's)"
    )
    m = p.add_argument_group("model")
    m.add_argument("--tokenizer", help="tokenizer file or folder (default: found with the model)")
    m.add_argument("--device", default="auto", help="cpu, cuda, npu or auto")
    m.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    m.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    m.add_argument("--max-length", type=int, help="longest input (default: the model's context)")
    m.add_argument("--tp", type=int, default=1, help="tensor parallel degree (under torchrun)")
    m.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    args = _parser().parse_args(argv)
    _check_args(args)
    if args.task.startswith(LM_EVAL_PREFIX):
        return _lm_eval(args)
    task = get_task(args.task)
    if args.task == "humaneval" and not args.allow_code_execution:
        raise ConfigError(
            "humaneval runs model-written code: pass --allow-code-execution to run it in the "
            "sandbox (subprocess without network, as an unprivileged user, with time, memory "
            "and process limits)"
        )
    if (args.context_lengths or args.depths) and args.task != "needle":
        raise ConfigError("--context-lengths and --depths are options of --task needle")
    if args.data is None and args.task not in ("demo", "needle"):
        raise ConfigError(f"--task {args.task} needs --data DIR ({task.layout})")
    shots = task.default_shots if args.shots is None else args.shots
    fewshot = _fewshot(args.fewshot_template)
    data = Path(args.data) if args.data else None
    if data is not None and not data.exists():
        raise ConfigError(f"--data {data} does not exist")
    if args.task == "needle":  # the haystacks are measured in the model's tokens
        scorer = _scorer(args)
        task = _needle(args, scorer)
        items = task.load(None, shots=0, fewshot=None)[: args.limit]
    else:
        items = task.load(data, shots=shots, fewshot=fewshot)[: args.limit]
        if not items:
            raise DataError(f"--data {data}: no {args.task} items in it ({task.layout})")
        scorer = _scorer(args)
    from mindspeed_eval.runner import RunOptions, run_task

    started = time.perf_counter()
    options = RunOptions(
        mode=args.mode, samples=args.samples, temperature=args.temperature, seed=args.seed,
        max_gen_toks=args.max_gen_toks, progress=not args.no_progress,
    )  # fmt: skip
    result = run_task(task, items, scorer, options)
    if scorer.mesh.is_main:
        _report(args, result, shots, time.perf_counter() - started)
    return 0


def _check_args(args) -> None:
    """Values argparse lets through that would run a wrong evaluation, refused before anything
    is loaded or scored."""
    for flag, value, least in (("--limit", args.limit, 1), ("--shots", args.shots, 0),
                               ("--samples", args.samples, 1), ("--batch-size", args.batch_size, 1),
                               ("--max-gen-toks", args.max_gen_toks, 1),
                               ("--max-length", args.max_length, 1), ("--tp", args.tp, 1)):  # fmt: skip
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    check_folder(args.output, "--output")  # before the evaluation, not after it


def _scorer(args):
    from mindspeed_eval.loading import load_for_eval
    from mindspeed_eval.scorer import Scorer, ScorerConfig

    model = args.model or str(_demo_checkpoints())
    loaded = load_for_eval(
        model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype, tp=args.tp
    )
    return Scorer(loaded, ScorerConfig(batch_size=args.batch_size, max_length=args.max_length))


def _needle(args, scorer):
    from mindspeed_eval.tasks.needle import NeedleTask

    room = scorer.max_length - (args.max_gen_toks or NeedleTask.max_gen_toks)
    lengths = _ints("--context-lengths", args.context_lengths) or sorted(
        {max(32, room // 4), max(32, room // 2), room}
    )
    if max(lengths) > room:
        raise ConfigError(
            f"--context-lengths {max(lengths)} does not fit the model's context of "
            f"{scorer.max_length} tokens with {scorer.max_length - room} to generate (longest: "
            f"{room}; --max-length raises the context)"
        )
    depths = _ints("--depths", args.depths) or [0, 25, 50, 75, 100]
    return NeedleTask(lengths, depths, count_tokens=lambda text: len(scorer.tok_encode(text)))


def _ints(flag: str, text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _demo_checkpoints() -> Path:
    """The pretrain demo's checkpoints; trained first (as `mindspeed pretrain` does) if absent."""
    checkpoints = DEMO_RUN / "checkpoints"
    if not (checkpoints / "latest").is_file():
        print(
            f"no model at {checkpoints}: training the demo first (`mindspeed pretrain`, a few minutes)",
            file=sys.stderr,
        )
        done = subprocess.run([sys.executable, "-m", "mindspeed_llm.pretrain"], check=False)
        if done.returncode != 0 or not (checkpoints / "latest").is_file():
            raise CheckpointError(f"the demo run did not leave checkpoints in {checkpoints}")
    return checkpoints


def _fewshot(path: str | None) -> dict | None:
    if path is None:
        return None
    from mindspeed_eval.tasks.base import read_json

    content = read_json(Path(path))
    if not isinstance(content, dict):
        raise ConfigError(f"--fewshot-template {path} must hold a JSON object {{subject: text}}")
    return content


def _report(args, result, shots: int, seconds: float) -> None:
    from mindspeed_eval.report import table, write_outputs

    header = {"model": args.model or str(DEMO_RUN / "checkpoints"), "data": args.data, "shots": shots,
              "items": len(result.grades), "seconds": round(seconds, 2)}  # fmt: skip
    print(f"{result.task} ({result.mode}, {shots}-shot) on {header['model']}")
    print(table(result))
    paths = write_outputs(Path(args.output), result, header)
    print(f"wrote {', '.join(str(p) for p in paths)}")


def _lm_eval(args) -> int:
    from mindspeed_eval.lmeval_tasks import run_lm_eval

    name = args.task[len(LM_EVAL_PREFIX) :]
    if importlib.util.find_spec("lm_eval") is None:  # before the model is loaded
        raise ConfigError(
            "--task lm-eval:NAME needs lm-eval: pip install 'mindspeed-eval[lm-eval]'"
        )
    scorer = _scorer(args)
    results = run_lm_eval(
        scorer, name, include=Path(args.data) if args.data else None,
        num_fewshot=args.shots, limit=args.limit, apply_chat_template=args.mode == "chat",
    )  # fmt: skip
    if results is not None and scorer.mesh.is_main:
        from lm_eval.utils import make_table

        from mindspeed_eval.report import atomic_write

        print(make_table(results))
        Path(args.output).mkdir(parents=True, exist_ok=True)
        text = json.dumps(
            {k: results[k] for k in ("results", "versions", "n-shot") if k in results},
            indent=1,
            default=str,
        )
        print(f"wrote {atomic_write(Path(args.output) / f'lm-eval_{name}_results.json', text)}")
    return 0


command = Command(help="evaluate a model on benchmarks (no arguments: the pretrain demo)", run=main)


if __name__ == "__main__":  # torchrun -m mindspeed_eval.cli ...
    argv = sys.argv[1:]
    sys.exit(guarded(main, [a for a in argv if a != "--debug"], debug=debug_enabled(argv)))
