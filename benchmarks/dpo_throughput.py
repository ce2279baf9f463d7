"""`mindspeed dpo` against TRL's DPOTrainer: the same model, pairs and batch, one epoch.

    python benchmarks/dpo_throughput.py [--shape short|real] [--pairs 256] [--seq N] [--batch 8]
                                        [--threads 2]

Both sides train the same randomly initialised Llama folder as `sft_throughput.py` (vocab
2048, hidden 256, 4 layers, fp32) with sigmoid DPO (beta 0.1) and a frozen reference copy,
on the same generated preference pairs (a ChatML prompt of 15-60 words, two replies of 20-100
words), `--batch` pairs per optimizer step, AdamW. Ours is what `mindspeed dpo` runs in one
process: both replies of a pair packed in one row (`cu_seqlens`), one policy and one
reference forward per micro-batch; theirs is `trl.DPOTrainer` (chosen and rejected
concatenated into one padded batch) on transformers' LlamaForCausalLM with SDPA attention.

Each side runs in its own subprocess: pairs/s is the epoch's pairs over the wall time of the
training steps (tokenisation and model loading left out on both sides); peak memory is the
peak resident memory minus what the process held before the models existed. Prints one JSON
line with both sides and the ratios (ours / theirs). The goal (issue A1) is >= 1.5x TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from sft_throughput import WORDS, _peak_mb, _rss_mb, make_inputs, run_sides

SHAPES = {
    # shape: (prompt words, reply words, --seq), each words range inclusive
    "short": ((15, 60), (20, 100), 512),
    # A3 item 5's real lengths: prompts of about 512 and replies of about 256 tokens (a word
    # of this vocabulary is about one token), both replies and the prompt twice in one row
    "real": ((480, 512), (224, 256), 2048),
}


def make_pairs(root: Path, num_pairs: int, shape: str = "short") -> Path:
    rng = random.Random(1)
    prompt, reply, _ = SHAPES[shape]
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    rows = [{"prompt": text(rng.randint(*prompt)), "chosen": text(rng.randint(*reply)),
             "rejected": text(rng.randint(*reply))} for _ in range(num_pairs)]  # fmt: skip
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ours(folder: Path, data: Path, args) -> dict:
    from mindspeed_align.dpo import PreferenceObjective
    from mindspeed_align.dpo_config import DPOConfig
    from mindspeed_align.pairs import PairData
    from mindspeed_core.config import load_config
    from mindspeed_core.distributed import destroy_distributed, init_distributed
    from mindspeed_llm.train.trainer import Trainer

    cfg = load_config(DPOConfig, None, [
        f"--model.hf_path={folder}", f"--data.paths=[{data}]", f"--data.seq_len={args.seq}",
        "--data.epochs=1", "--data.valid_fraction=0", f"--data.cache_dir={folder.parent / 'cache'}",
        f"--train.micro_batch={args.batch}", f"--train.global_batch={args.batch}",
        "--train.eval_interval=0", "--optim.warmup_steps=1", "--optim.lr=1e-5",
        # a reference forward every step, as TRL's; auto would precompute outside the timing
        "--dpo.ref=model", f"--dpo.shared_prompts={args.shared_prompts}",
        f"--logging.run_dir={folder.parent / 'run'}"])  # fmt: skip
    info = init_distributed(device_type="cpu")
    baseline = _rss_mb()
    objective = PreferenceObjective(cfg.dpo)
    trainer = Trainer(cfg, info, data=PairData, objective=objective, command="dpo")
    pairs, start = 0, time.perf_counter()
    for _ in range(cfg.train.steps):
        batches = trainer.data.next_step()
        pairs += sum(int(objective.num_units(b)) for b in batches)
        result = trainer.step(batches)
    seconds = time.perf_counter() - start
    destroy_distributed()
    return {"pairs_per_s": round(pairs / seconds, 2), "pairs": pairs, "steps": cfg.train.steps,
            "seconds": round(seconds, 2), "peak_mem_mb": round(_peak_mb() - baseline, 1),
            "last_loss": round(result.loss, 4)}  # fmt: skip


def _theirs(folder: Path, data: Path, args) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                           "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                           "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                          for r in rows])  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    baseline = _rss_mb()
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        str(folder), dtype=torch.float32, attn_implementation="sdpa")
    config = trl.DPOConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=args.batch,
                           max_length=args.seq, beta=0.1, num_train_epochs=1, learning_rate=1e-5,
                           warmup_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                           logging_steps=1000, dataloader_num_workers=0, disable_tqdm=True,
                           dataset_num_proc=None)  # fmt: skip
    trainer = trl.DPOTrainer(model=load(), ref_model=load(), args=config, train_dataset=dataset,
                             processing_class=tok)  # fmt: skip
    start = time.perf_counter()
    out = trainer.train()
    seconds = time.perf_counter() - start
    return {"pairs_per_s": round(len(rows) / seconds, 2), "pairs": len(rows), "steps": out.global_step,
            "seconds": round(seconds, 2), "peak_mem_mb": round(_peak_mb() - baseline, 1),
            "last_loss": round(out.training_loss, 4)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="short",
                        help="short: prompts of 15-60 words, replies of 20-100 (seq 512); real: "
                             "prompts of ~512 and replies of ~256 tokens (seq 2048)")
    parser.add_argument("--seq", type=int, help="row length (default: the shape's)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shared-prompts", choices=["auto", "off"], default="auto",
                        help="ours: each pair's prompt once in its row (auto) or twice (off)")
    parser.add_argument("--side", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or SHAPES[args.shape][2]
    if args.side:  # one side, in this subprocess
        import torch

        torch.set_num_threads(args.threads)
        side = _ours if args.side == "ours" else _theirs
        print(json.dumps(side(args.root / "model", args.root / "pairs.jsonl", args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_inputs(root, 1)
        make_pairs(root, args.pairs, args.shape)
        results = run_sides(__file__, root, args.threads, [f"--seq={args.seq}", f"--batch={args.batch}",
                                                           f"--shared-prompts={args.shared_prompts}"])
    ours, theirs = results["ours"], results["theirs"]
    print(json.dumps({
        "benchmark": "dpo_throughput", "shape": args.shape, "dtype": "fp32", "seq": args.seq,
        "batch_pairs": args.batch, "shared_prompts": args.shared_prompts,
        "ours": ours, "trl": theirs, "speedup": round(ours["pairs_per_s"] / theirs["pairs_per_s"], 2),
        "memory_ratio": round(ours["peak_mem_mb"] / theirs["peak_mem_mb"], 2),
        "load_avg_1min": round(os.getloadavg()[0], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
