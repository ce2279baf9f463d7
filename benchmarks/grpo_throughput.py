"""`mindspeed grpo` against TRL's GRPOTrainer: the same model, prompts, group size and lengths.

    python benchmarks/grpo_throughput.py [--shape short|real] [--steps 8] [--prompts-per-step 4]
                                         [--n 8] [--max-new-tokens N] [--threads 2] [--async]
                                         [--engines native,vllm [--vllm-python PY]]
                                         [--bounded K]

Both sides train the randomly initialised Llama folder of `sft_throughput.py` (hidden 256,
4 layers, fp32) with GRPO (group-normalised advantages, PPO clip 0.2, no KL so no reference
model, one update per rollout, AdamW) on the same generated prompts (10-30 words each),
`--n` samples per prompt of at most `--max-new-tokens` tokens at temperature 1, and the same
reward function (`word_count_reward`, in-process on both sides). Ours is what `mindspeed grpo`
runs in one process (`GRPOStep`: rollout on our KV-cache engine with one prefill per prompt,
old log-probs recomputed, one packed training step); theirs is `trl.GRPOTrainer` with
transformers' `generate` (no vLLM) on LlamaForCausalLM with SDPA attention.

Each side runs in its own subprocess: samples/s is the completions of every step over the
wall time of the steps (model loading left out on both sides). Prints one JSON line with
both sides, their mean completion lengths and the ratio (ours / theirs). The goal (issue
A2) is >= 1.5x TRL on CPU.

`--async` instead runs ours twice, synchronous and with `grpo.async_rollout one_step` (the
next step's rollout sampling in a thread while this step trains), and reports the overlap
gain (async samples/s over sync; A4 item 5). The first step of the async run samples
synchronously, as every run's first step must. `--async --bounded K` adds a third run, with
`grpo.async_rollout bounded --grpo.max_staleness K` (rollouts of up to K steps ahead, weights
synced every step even mid-sample), and its gain over sync.

`--engines native,vllm` instead runs ours with each rollout engine (`grpo.rollout_engine`;
vLLM in its own environment: `--vllm-python`, MINDSPEED_VLLM_PYTHON, or the one the trainer
creates once) and reports, per engine, samples/s and the share of the steps' wall time spent
generating (`generate_share`; under async rollouts it overlaps training), and vLLM's
samples/s over ours; with `--async` and/or `--bounded K` each engine also runs one-step
and/or bounded and reports its gain over that engine's synchronous run
(`vllm_bounded_k2_gain`). vLLM's start-up is left out
like every side's model loading; its weight sync each step is in the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from sft_throughput import WORDS, _peak_mb, _rss_mb, make_inputs, run_sides


def word_count_reward(prompts, completions, **_) -> list[float]:
    """The number of times "apples" appears in the completion (a cheap, dense reward)."""
    return [float(str(c).count("apples")) for c in completions]


SHAPES = {
    # shape: (prompt words, inclusive; --max-new-tokens; our data.seq_len)
    "short": ((10, 30), 32, 128),
    # A3 item 5's real lengths: prompts of about 256 tokens (a word of this vocabulary is
    # about one token), completions of up to 256 (a random model rarely stops early)
    "real": ((240, 256), 256, 640),
}


def make_prompts(root: Path, count: int, shape: str = "short") -> Path:
    rng = random.Random(2)
    words = SHAPES[shape][0]
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))}
            for _ in range(count)]  # fmt: skip
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ASYNC_SIDES = {"ours_async": "one_step", "ours_bounded": "bounded",
               "ours_vllm_async": "one_step", "ours_vllm_bounded": "bounded"}  # fmt: skip
"""Our runs with `grpo.async_rollout` other than off, by side (`ours_vllm*`: on vLLM)."""
ENGINE_SIDES = {"native": "ours", "vllm": "ours_vllm"}
"""Each engine's synchronous side; its async ones add `_async` and `_bounded`."""


def _ours(folder: Path, prompts: Path, args) -> dict:
    from mindspeed_align.rl.config import GRPOConfig
    from mindspeed_align.rl.data import PromptSource, read_prompts
    from mindspeed_align.rl.grpo import GRPOMethod
    from mindspeed_align.rl.rewards import Rewards
    from mindspeed_core.config import load_config
    from mindspeed_core.distributed import destroy_distributed, init_distributed
    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_llm.train.trainer import Trainer

    samples, vllm = args.prompts_per_step * args.n, args.side.startswith("ours_vllm")
    cfg = load_config(GRPOConfig, None, [
        f"--model.hf_path={folder}", f"--data.prompts={prompts}", f"--data.tokenizer={folder}",
        f"--data.seq_len={args.seq_len}", "--data.eval_prompts=0", f"--grpo.n={args.n}",
        f"--grpo.max_new_tokens={args.max_new_tokens}", "--grpo.reward_workers=0",
        "--grpo.rewards=[grpo_throughput:word_count_reward]", "--grpo.kl_coef=0",
        f"--train.steps={args.steps}", f"--train.micro_batch={samples}",
        f"--train.global_batch={samples}", "--optim.lr=1e-5",
        f"--grpo.async_rollout={ASYNC_SIDES.get(args.side, 'off')}",
        f"--grpo.max_staleness={args.bounded if args.side.endswith('_bounded') else 1}",
        f"--grpo.shared_prompts={args.shared_prompts}",
        f"--grpo.rollout_engine={'vllm' if vllm else 'native'}",
        *([f"--grpo.vllm_python={args.vllm_python}"] if vllm and args.vllm_python else []),
        f"--logging.run_dir={folder.parent / 'run'}"])  # fmt: skip
    info = init_distributed(device_type="cpu")
    tokenizer = load_tokenizer(folder)
    records = read_prompts(prompts)
    rewards = Rewards(cfg.grpo.rewards, workers=0)

    def data(cfg_, model_cfg):
        return PromptSource(records, tokenizer, max_prompt_len=args.seq_len - args.max_new_tokens,
                            prompts_per_step=args.prompts_per_step, seed=0)  # fmt: skip

    baseline = _rss_mb()
    trainer = Trainer(
        cfg, info, data=data, objective=GRPOMethod(cfg, tokenizer, rewards), command="grpo"
    )
    step = trainer.step
    generating = [0.0]
    generate = step.rollout.generate

    def timed(*a, **k):  # the share of the step spent generating
        t = time.perf_counter()
        out = generate(*a, **k)
        generating[0] += time.perf_counter() - t
        return out

    step.rollout.generate = timed
    lengths, start = [], time.perf_counter()
    for _ in range(args.steps):
        result = step(trainer.data.next_step())
        trainer.state.step += 1
        lengths.append(result.metrics["response/length_mean"])
    seconds = time.perf_counter() - start
    step.settle()
    if hasattr(step.rollout, "close"):
        step.rollout.close()
    destroy_distributed()
    return {"samples_per_s": round(samples * args.steps / seconds, 2), "steps": args.steps,
            "generate_share": round(generating[0] / seconds, 3),
            "seconds": round(seconds, 2), "mean_completion_tokens": round(sum(lengths) / len(lengths), 2),
            "peak_mem_mb": round(_peak_mb() - baseline, 1)}  # fmt: skip


def _theirs(folder: Path, prompts: Path, args) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    dataset = datasets.Dataset.from_list(rows)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    baseline = _rss_mb()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    samples = args.prompts_per_step * args.n
    config = trl.GRPOConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=samples,
                            num_generations=args.n, max_completion_length=args.max_new_tokens,
                            steps_per_generation=1, num_iterations=1, beta=0.0, temperature=1.0,
                            max_steps=args.steps, learning_rate=1e-5, report_to=[], use_cpu=True,
                            save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                            disable_tqdm=True, shuffle_dataset=False)  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[word_count_reward], args=config,
                              train_dataset=dataset, processing_class=tok)  # fmt: skip
    start = time.perf_counter()
    out = trainer.train()
    seconds = time.perf_counter() - start
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h]  # fmt: skip
    return {"samples_per_s": round(samples * out.global_step / seconds, 2), "steps": out.global_step,
            "seconds": round(seconds, 2), "mean_completion_tokens": round(sum(lengths) / max(len(lengths), 1), 2),
            "peak_mem_mb": round(_peak_mb() - baseline, 1)}  # fmt: skip


def _bounded(results: dict, k: int, sync: dict) -> dict:
    """The bounded run's entries of the --async report (none without --bounded)."""
    if not k:
        return {}
    bounded = results["ours_bounded"]
    return {f"bounded_k{k}": bounded,
            "bounded_gain": round(bounded["samples_per_s"] / sync["samples_per_s"], 2)}  # fmt: skip


def _engine_sides(engine: str, args) -> list[str]:
    """The sides of one engine under --engines: synchronous, with --async one-step, with
    --bounded K bounded."""
    sync = ENGINE_SIDES[engine]
    return [sync, *([f"{sync}_async"] if args.async_ else []),
            *([f"{sync}_bounded"] if args.bounded else [])]  # fmt: skip


def _engine_report(engine: str, results: dict, args):
    """(key, value) of one engine's entries in the --engines report."""
    sync = ENGINE_SIDES[engine]
    yield engine, results[sync]
    for side, name in ((f"{sync}_async", "one_step"), (f"{sync}_bounded", f"bounded_k{args.bounded}")):
        if side in results:
            yield f"{engine}_{name}", results[side]
            yield f"{engine}_{name}_gain", round(results[side]["samples_per_s"] / results[sync]["samples_per_s"], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="short",
                        help="short: prompts of 10-30 words, 32 new tokens; real: prompts of "
                             "~256 tokens, 256 new tokens")
    parser.add_argument("--max-new-tokens", type=int, help="default: the shape's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="ours synchronous vs ours one-step off-policy, no TRL")
    parser.add_argument("--bounded", type=int, default=0, metavar="K",
                        help="with --async: also ours with async_rollout bounded, max_staleness K")
    parser.add_argument("--shared-prompts", choices=["auto", "off"], default="auto",
                        help="ours: a prompt once per group of completions (auto) or in each")
    parser.add_argument("--engines", help="native,vllm: ours with each rollout engine, no TRL")
    parser.add_argument("--vllm-python", help="vLLM's interpreter (default: see the docstring)")
    parser.add_argument("--side", choices=["ours", *ASYNC_SIDES, "ours_vllm", "theirs"],
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.max_new_tokens = args.max_new_tokens or SHAPES[args.shape][1]
    args.seq_len = SHAPES[args.shape][2]
    if args.side:  # one side, in this subprocess
        import torch

        torch.set_num_threads(args.threads)
        sys.path.insert(0, str(Path(__file__).parent))  # the reward spec's module
        side = _theirs if args.side == "theirs" else _ours
        print(json.dumps(side(args.root / "model", args.root / "prompts.jsonl", args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_inputs(root, 1)
        make_prompts(root, args.steps * args.prompts_per_step, args.shape)
        if args.engines:
            sides = tuple(side for e in args.engines.split(",") for side in _engine_sides(e, args))
        else:
            sides = (("ours", "ours_async", *(("ours_bounded",) if args.bounded else ()))
                     if args.async_ else ("ours", "theirs"))  # fmt: skip
        results = run_sides(__file__, root, args.threads, [
            f"--steps={args.steps}", f"--prompts-per-step={args.prompts_per_step}", f"--n={args.n}",
            f"--max-new-tokens={args.max_new_tokens}", f"--shape={args.shape}",
            f"--shared-prompts={args.shared_prompts}", f"--bounded={args.bounded}",
            *([f"--vllm-python={args.vllm_python}"] if args.vllm_python else [])], sides)  # fmt: skip
    if args.engines:
        out = {"benchmark": "grpo_throughput_engines", "shape": args.shape, "dtype": "fp32",
               "n": args.n, "prompts_per_step": args.prompts_per_step,
               "max_new_tokens": args.max_new_tokens, "threads": args.threads,
               **{k: v for e in args.engines.split(",") for k, v in _engine_report(e, results, args)}}  # fmt: skip
        if "native" in out and "vllm" in out:
            out["vllm_over_native"] = round(out["vllm"]["samples_per_s"] / out["native"]["samples_per_s"], 2)
        print(json.dumps({**out, "load_avg_1min": round(os.getloadavg()[0], 2)}))
        return
    if args.async_:
        sync, overlapped = results["ours"], results["ours_async"]
        print(json.dumps({
            "benchmark": "grpo_throughput_async", "shape": args.shape, "dtype": "fp32", "n": args.n,
            "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "sync": sync, "one_step": overlapped,
            "overlap_gain": round(overlapped["samples_per_s"] / sync["samples_per_s"], 2),
            "memory_ratio": round(overlapped["peak_mem_mb"] / max(sync["peak_mem_mb"], 1e-9), 2),
            "load_avg_1min": round(os.getloadavg()[0], 2),
            **_bounded(results, args.bounded, sync)}))  # fmt: skip
        return
    ours, theirs = results["ours"], results["theirs"]
    print(json.dumps({
        "benchmark": "grpo_throughput", "shape": args.shape, "dtype": "fp32", "n": args.n,
        "shared_prompts": args.shared_prompts,
        "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
        "ours": ours, "trl": theirs, "speedup": round(ours["samples_per_s"] / theirs["samples_per_s"], 2),
        "memory_ratio": round(ours["peak_mem_mb"] / max(theirs["peak_mem_mb"], 1e-9), 2),
        "load_avg_1min": round(os.getloadavg()[0], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
