"""Our training step against Hugging Face transformers' LlamaForCausalLM, same config and data.

    python benchmarks/train_throughput.py [--dtypes fp32,bf16] [--steps 3] [--device cpu] [--compile]

Both sides build the same Llama (headline: vocab 32000, hidden 512, intermediate 1376,
4 layers, 8 heads, 4 kv heads, seq 512, micro-batch 4), train it with AdamW on the same
random tokens, and are timed over `--steps` steps after one warm-up step. Ours is
what `mindspeed pretrain` runs in one process: mindspeed_llm's Transformer on
mindspeed_ops, the chunked cross entropy, core's AdamW container. Theirs is the
documented way to train transformers: `model(input_ids, labels=...)`, `loss.backward()`,
`torch.optim.AdamW`. bf16 means fp32 master weights with `torch.autocast` on both sides.
`--compile`: our blocks compiled as `train.compile: true` compiles them (`apply_compile`); the
compilation happens in the warm-up step, which is not timed.

Each side runs in its own subprocess so its peak memory can be read cleanly: peak
resident memory (CPU) or peak allocated memory (accelerator) minus what the process
held before the model existed. Prints one JSON line per dtype with both sides and the
ratios (ours / theirs).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

HEADLINE = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
SEQ, MICRO_BATCH = 512, 4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mb(device) -> float:
    import torch

    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return torch.get_device_module(device.type).max_memory_allocated(device) / 2**20


def _ours(device, dtype, compile=False):
    import mindspeed_ops
    from mindspeed_core.optim import build_optimizers
    from mindspeed_core.parallel import apply_compile
    from mindspeed_llm.models import build_model_config, get_model_spec

    config = build_model_config("llama", hf_config=HEADLINE)
    model = get_model_spec("llama").build(config).to(device)
    if compile:
        apply_compile(model)
    optimizer = build_optimizers(model, lr=1e-4, weight_decay=0.1)

    def step(tokens, labels):
        with torch_autocast(device, dtype):
            logits = model(tokens)
            loss = mindspeed_ops.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return model, step


def _theirs(device, dtype, compile=False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in HEADLINE.items() if k != "model_type"})
    model = LlamaForCausalLM(config).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
    )

    def step(tokens, labels):
        with torch_autocast(device, dtype):
            # transformers shifts labels itself: the usual call passes the inputs as labels.
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return model, step


def torch_autocast(device, dtype):
    import contextlib

    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def run_side(side: str, dtype_name: str, steps: int, device_name: str, compile: bool = False) -> dict:
    import torch

    from mindspeed_core import device as dev
    from mindspeed_core.training import dense_params, flops_per_token

    device = torch.device(device_name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    data = torch.randint(0, HEADLINE["vocab_size"], (steps + 1, MICRO_BATCH, SEQ + 1))
    baseline = _rss_mb() if device.type == "cpu" else 0.0
    model, step = (_ours if side == "ours" else _theirs)(device, dtype, compile)
    n = dense_params(model)
    flops = flops_per_token(n, HEADLINE["num_hidden_layers"], HEADLINE["hidden_size"], SEQ)
    losses, times = [], []
    for i in range(steps + 1):  # the first step warms up (allocator, kernels)
        batch = data[i].to(device)
        dev.synchronize(device)
        start = time.perf_counter()
        loss = step(batch[:, :-1], batch[:, 1:])
        dev.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    seconds = sum(times[1:]) / steps
    return {
        "tokens_per_s": round(MICRO_BATCH * SEQ / seconds, 1),
        "flops_per_token": flops,
        "peak_mem_mb": round(_peak_mb(device) - baseline, 1),
        "step_s": round(seconds, 3),
        "first_loss": round(losses[0], 4),
    }


def _peak_flops(device_name: str, dtype_name: str) -> float:
    import torch

    from mindspeed_core import device as dev

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    return dev.peak_flops(torch.device(device_name), dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="compile our blocks")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.dtype, args.steps, args.device, args.compile)))
        return
    for dtype in args.dtypes.split(","):
        result = {"bench": "train_step", "config": "llama 4x512, vocab 32000, seq 512, mb 4"}
        result.update(dtype=dtype, device=args.device, compile=args.compile)
        for side in ("ours", "transformers"):
            cmd = [sys.executable, __file__, "--side", side, "--dtype", dtype]
            cmd += ["--steps", str(args.steps), "--device", args.device]
            cmd += ["--compile"] if args.compile and side == "ours" else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result[side] = json.loads(out.strip().splitlines()[-1])
        ours, theirs = result["ours"], result["transformers"]
        peak = _peak_flops(args.device, dtype)  # one measurement for both sides
        for side in (ours, theirs):
            side["mfu"] = round(side["tokens_per_s"] * side.pop("flops_per_token") / peak, 4)
        result["speedup"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
        result["memory_ratio"] = round(ours["peak_mem_mb"] / theirs["peak_mem_mb"], 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
