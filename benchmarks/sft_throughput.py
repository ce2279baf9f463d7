"""`mindspeed sft` against TRL's SFTTrainer: the same model, samples and packing, one epoch.

    python benchmarks/sft_throughput.py [--samples 256] [--seq 512] [--batch 4] [--threads 2]
                                        [--lora R]

Both sides fine-tune the same randomly initialised Llama folder (vocab 2048, hidden 256,
intermediate 688, 4 layers, 4 heads, 2 kv heads, fp32) on the same chat samples (a
generated `messages` file, ChatML, 40-200 tokens each) for one epoch, packing samples
into rows of `--seq` tokens, `--batch` rows per optimizer step, AdamW, completion-only
(assistant-only) loss. Ours is what `mindspeed sft` runs in one process (the trainer's
step: packed rows with `cu_seqlens`, mindspeed_ops' kernels and chunked cross entropy);
theirs is `trl.SFTTrainer(packing=True)` (best-fit-decreasing packing, padding-free
rows with position ids) on transformers' LlamaForCausalLM with SDPA attention.

`--lora R`: both sides train LoRA adapters of rank R (alpha 2R) on every linear layer of
the decoder instead of all weights (ours: `--lora.rank R`; theirs: `peft_config=
peft.LoraConfig(...)` passed to SFTTrainer).

`--skewed`: our SFT against itself on samples of 32 to 2048 tokens (log-uniform: many
short, a few long; `--seq` 2048, `data.mode=pad`, `--samples` 64 by default), fixed rows
(`--batch` rows per micro-batch, each padded to the step's longest, `--global` samples a
step) against `train.micro_batch_tokens` (`--budget`, default `--batch` x `--seq`: the same
largest micro-batch), one epoch each; and, on the same samples, the tokens per
data-parallel rank of each step under 2 and 4 ranks, max/min, as today's fixed rows
assign them and as the budget's balancing does (the data source's own
`rank_tokens_max`/`rank_tokens_min`, no training). samples/s leaves the first step out on
both sides (on a fresh machine it compiles the CPU kernels).

Each side runs in its own subprocess: samples/s is the epoch's samples over the wall
time of the training steps (tokenisation and model loading left out on both sides);
peak memory is the peak resident memory minus what the process held before the model
existed. Prints one JSON line with both sides and the ratios (ours / theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["alice", "bob", "carol", "apples", "rivers", "tools", "counts", "three", "seven", "plus", "is", "the", "a", "of", "to", "and", "garden", "market", "library", "harbor", "forest", "school", "red", "blue", "green", "yellow"]  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_inputs(root: Path, num_samples: int, skewed: bool = False) -> tuple[Path, Path]:
    """A Llama folder (random weights, BPE tokenizer, ChatML) and a messages file
    (`skewed`: replies drawn so that samples take 32 to 2048 tokens, log-uniform)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": text(rng.randint(15, 60))},
                          {"role": "assistant", "content": text(rng.randint(20, 140))}]}
            for _ in range(num_samples)]  # fmt: skip
    if skewed:  # a word is about one token; the template and the question take ~25
        sizes = [round(32 * 64 ** rng.random()) for _ in range(num_samples)]
        rows = [{"messages": [{"role": "user", "content": text(10)},
                              {"role": "assistant", "content": text(max(4, n - 25))}]}
                for n in sizes]  # fmt: skip
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<|im_start|>",
                                  "<|im_end|>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([text(50) for _ in range(2000)], trainer=trainer)
    folder = root / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHATML}))  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    model.save_pretrained(folder)
    return folder, data


def _ours(folder: Path, data: Path, args) -> dict:
    import torch

    from mindspeed_core.config import load_config
    from mindspeed_core.distributed import destroy_distributed, init_distributed
    from mindspeed_llm.data.collate import IGNORE_INDEX
    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.train.objectives import NextToken, segment_ids
    from mindspeed_llm.train.sft_config import SFTConfig
    from mindspeed_llm.train.sft_data import SFTData
    from mindspeed_llm.train.trainer import Trainer

    cfg = load_config(SFTConfig, None, _our_args(folder, data, args))
    info = init_distributed(device_type="cpu")
    baseline = _rss_mb()
    # as `mindspeed sft` runs it: logits of the replies only (MINDSPEED_ALL_LOGITS=1: every
    # position, the figure before A3)
    every = os.environ.get("MINDSPEED_ALL_LOGITS") == "1"
    objective = NextToken(supervised_logits_only=not every)
    trainer = Trainer(cfg, info, data=SFTData, objective=objective, command="sft",
                      **lora_trainer_options(cfg.lora))  # fmt: skip
    # --skewed: the first step is left out of the time on both sides (it compiles the CPU
    # kernels on a fresh machine, which only the side that runs first would pay)
    warm = 1 if args.skewed else 0
    samples, start = 0, time.perf_counter()
    for step in range(cfg.train.steps):
        if step == warm and warm:
            samples, start = 0, time.perf_counter()
        for batch in (step_batches := trainer.data.next_step()):
            docs = segment_ids(batch["cu_seqlens"], batch["labels"].numel())
            samples += len(torch.unique(docs[batch["labels"].flatten() != IGNORE_INDEX]))
        result = trainer.step(step_batches)
    seconds = time.perf_counter() - start
    destroy_distributed()
    return {"samples_per_s": round(samples / seconds, 2), "samples": samples,
            "steps": cfg.train.steps, "seconds": round(seconds, 2),
            "peak_mem_mb": round(_peak_mb() - baseline, 1), "last_loss": round(result.loss, 4)}  # fmt: skip


def _our_args(folder: Path, data: Path, args, budget: bool | None = None) -> list[str]:
    """`mindspeed sft`'s options for `args` (`budget`: the --skewed side with the token
    budget; default: `args.side`)."""
    budget = args.side == "budget" if budget is None else budget
    common = [f"--model.hf_path={folder}", f"--data.paths=[{data}]", "--data.handler=messages",
              f"--data.seq_len={args.seq}", "--data.epochs=1", "--data.valid_fraction=0",
              f"--data.cache_dir={folder.parent / 'cache'}", "--train.eval_interval=0",
              "--optim.warmup_steps=1", "--optim.lr=1e-4", f"--logging.run_dir={folder.parent / 'run'}",
              f"--lora.rank={args.lora}", f"--lora.alpha={2 * args.lora}"]  # fmt: skip
    if not args.skewed:
        return [*common, "--data.mode=pack", f"--train.micro_batch={args.batch}",
                f"--train.global_batch={args.batch}"]  # fmt: skip
    common += ["--data.mode=pad", f"--train.micro_batch={args.batch}",
               f"--train.global_batch={args.global_batch}"]  # fmt: skip
    if budget:
        common.append(f"--train.micro_batch_tokens={args.budget or args.batch * args.seq}")
    return common


def _balance(folder: Path, data: Path, args) -> dict:
    """max/min tokens per data-parallel rank over an epoch's steps, under 2 and 4 ranks:
    fixed rows against the budget's balancing (the data source alone, no model)."""
    from types import SimpleNamespace

    from mindspeed_core.config import load_config
    from mindspeed_llm.train.build import model_config
    from mindspeed_llm.train.sft_config import SFTConfig
    from mindspeed_llm.train.sft_data import SFTData

    out = {}
    for dp in (2, 4):
        found = {}
        for name, budget in (("fixed_rows", False), ("token_budget", True)):
            cfg = load_config(SFTConfig, None, _our_args(folder, data, args, budget))
            source = SFTData(cfg, model_config(cfg.model))
            accum = max(1, args.global_batch // (args.batch * dp))
            source.build(SimpleNamespace(rank=lambda axis: 0, dp=dp, cp=1, tp=1), accum)
            ratios = []
            for _ in range(cfg.train.steps):
                source.next_step()
                m = source.step_metrics
                ratios.append(m["rank_tokens_max"] / max(m["rank_tokens_min"], 1))
            found[name] = {"mean_max_min": round(sum(ratios) / len(ratios), 3),
                           "worst_max_min": round(max(ratios), 3)}  # fmt: skip
        out[f"dp{dp}"] = found
    return out


def _theirs(folder: Path, data: Path, args) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    rows = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": m[:1], "completion": m[1:]} for m in rows])
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    baseline = _rss_mb()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    config = trl.SFTConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=args.batch,
                           packing=True, max_length=args.seq, completion_only_loss=True,
                           num_train_epochs=1, learning_rate=1e-4, warmup_steps=1,
                           report_to=[], use_cpu=True, save_strategy="no", logging_steps=1000,
                           dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                             peft_config=peft_config)  # fmt: skip
    start = time.perf_counter()
    out = trainer.train()
    seconds = time.perf_counter() - start
    return {"samples_per_s": round(len(rows) / seconds, 2), "samples": len(rows),
            "steps": out.global_step, "seconds": round(seconds, 2),
            "peak_mem_mb": round(_peak_mb() - baseline, 1),
            "last_loss": round(out.training_loss, 4)}  # fmt: skip


def run_sides(script: str, root: Path, threads: int, args: list[str],
              sides: tuple[str, ...] = ("ours", "theirs")) -> dict:  # fmt: skip
    """Run `script --side ours` and `--side theirs` (or `sides`) each in its own process
    (clean peak memory) with `threads` threads; their last JSON lines, by side."""
    results = {}
    for side in sides:
        cmd = [sys.executable, script, "--side", side, "--root", str(root), f"--threads={threads}",
               *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(f"{side} failed:\n{done.stderr[-3000:]}")
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="default 256 (--skewed: 64)")
    parser.add_argument("--seq", type=int, help="default 512 (--skewed: 2048)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora", type=int, default=0, help="adapter rank (0: full)")
    parser.add_argument("--skewed", action="store_true",
                        help="fixed rows vs train.micro_batch_tokens, samples of 32-2048 tokens")  # fmt: skip
    parser.add_argument("--global", dest="global_batch", type=int, default=16,
                        help="--skewed: samples per step")  # fmt: skip
    parser.add_argument("--budget", type=int, default=0,
                        help="--skewed: tokens per micro-batch (0: batch x seq)")  # fmt: skip
    sides = ["ours", "theirs", "budget", "balance"]
    parser.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.samples = args.samples or (64 if args.skewed else 256)
    args.seq = args.seq or (2048 if args.skewed else 512)
    if args.side:  # one side, in this subprocess
        import torch

        torch.set_num_threads(args.threads)
        side = {"ours": _ours, "budget": _ours, "theirs": _theirs, "balance": _balance}[args.side]
        print(json.dumps(side(args.root / "model", args.root / "train.jsonl", args)))
        return
    if args.skewed:
        return _skewed(args)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_inputs(root, args.samples)
        results = run_sides(__file__, root, args.threads, [f"--seq={args.seq}", f"--batch={args.batch}",
                                                           f"--lora={args.lora}"])  # fmt: skip
    ours, theirs = results["ours"], results["theirs"]
    print(json.dumps({
        "benchmark": "sft_throughput", "mode": f"lora r={args.lora}" if args.lora else "full", "dtype": "fp32", "seq": args.seq,
        "batch_rows": args.batch, "ours": ours, "trl": theirs,
        "speedup": round(ours["samples_per_s"] / theirs["samples_per_s"], 2),
        "memory_ratio": round(ours["peak_mem_mb"] / theirs["peak_mem_mb"], 2)}))  # fmt: skip


def _skewed(args) -> None:
    """--skewed: fixed rows against the token budget, and the balance figures."""
    seq = args.seq
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_inputs(root, args.samples, skewed=True)
        options = [f"--seq={seq}", f"--batch={args.batch}", f"--lora={args.lora}", "--skewed",
                   f"--global={args.global_batch}", f"--budget={args.budget}"]  # fmt: skip
        sides = ("ours", "budget", "balance")
        results = run_sides(__file__, root, args.threads, options, sides=sides)
    fixed, budget = results["ours"], results["budget"]
    print(json.dumps({
        "benchmark": "sft_throughput", "mode": "skewed", "lengths": "32-2048 (log-uniform)",
        "dtype": "fp32", "seq": seq, "micro_batch_rows": args.batch,
        "global_batch": args.global_batch, "micro_batch_tokens": args.budget or args.batch * seq,
        "fixed_rows": fixed, "token_budget": budget,
        "speedup": round(budget["samples_per_s"] / fixed["samples_per_s"], 2),
        "tokens_per_rank": results["balance"]}))  # fmt: skip


if __name__ == "__main__":
    main()
