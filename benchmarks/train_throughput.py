"""Our training step against Hugging Face transformers' LlamaForCausalLM, same config and data.

    python benchmarks/train_throughput.py [--shape headline|smollm-135m|llama-1b] [--seq N]
        [--docs N] [--dtypes fp32,bf16] [--steps 3] [--device cpu] [--compile]

Both sides build the same Llama, train it with AdamW on the same random tokens, and are timed
over `--steps` steps after one warm-up step. Shapes (random weights):
- headline: vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads / 4 kv heads,
  seq 512, micro-batch 4, one document per row;
- smollm-135m: SmolLM-135M (vocab 49152, hidden 576, intermediate 1536, 30 layers, 9 heads /
  3 kv heads, tied embeddings), seq 4096, micro-batch 1, 8 packed documents per row;
- tiny: 2 layers of width 64, vocab 512, seq 128 (a smoke test: the device suite's dry run);
- llama-1b: Llama-3.2-1B (vocab 128256, hidden 2048, intermediate 8192, 16 layers, 32 heads /
  8 kv heads of 64, tied embeddings), seq 4096, micro-batch 1, 8 packed documents per row.
`--sides ours,transformers,torchtitan` adds torchtitan's Llama 3 (where it is installed);
`ours-fused` is ours with the loss through the fused linear + cross-entropy op
(`train.fused_linear_cross_entropy: on`), reported against ours as `fused_speed` and
`fused_memory`. `wide-vocab`: the headline's width with 2 layers and Llama 3's 128256-token
vocabulary, seq 2048, micro-batch 2 (the output layer dominates: where fusing pays).
Packed documents are what pretraining trains on (attention reset at each EOD): ours passes
their `cu_seqlens` (our flash kernel skips the attention across documents), transformers gets
position ids that restart at each document, from which it builds its block-diagonal mask for
SDPA (its documented padding-free path). Ours is
what `mindspeed pretrain` runs in one process: mindspeed_llm's Transformer on
mindspeed_ops, the chunked cross entropy, core's AdamW container. Theirs is the
documented way to train transformers: `model(input_ids, labels=...)`, `loss.backward()`,
`torch.optim.AdamW`. bf16 means fp32 master weights with `torch.autocast` on both sides.
`--compile`: our blocks compiled as `train.compile: on` compiles them (`apply_compile`), and
torchtitan's as torchtitan does (each block `torch.compile(fullgraph=True)`); transformers stays
eager. The compilation happens in the warm-up step, which is not timed.

Each side runs in its own subprocess so its peak memory can be read cleanly: peak
resident memory (CPU) or peak allocated memory (accelerator) minus what the process
held before the model existed. Prints one JSON line per dtype with both sides and the
ratios (ours / theirs).
"""

from __future__ import annotations

import argparse
import json
import re
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
SHAPES = {
    "headline": (HEADLINE, 512, 4, 1),
    "tiny": ({**HEADLINE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2}, 128, 2, 2),  # the device suite's dry run  # fmt: skip
    "smollm-135m": (
        {
            "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        },  # fmt: skip
        4096, 1, 8,
    ),
    "llama-1b": (
        {
            "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        },  # fmt: skip
        4096, 1, 8,
    ),
    "wide-vocab": ({**HEADLINE, "vocab_size": 128256, "num_hidden_layers": 2}, 2048, 2, 4),
}
"""name -> (HF config, seq, micro-batch, documents per row)."""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mb(device) -> float:
    import torch

    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return torch.get_device_module(device.type).max_memory_allocated(device) / 2**20


def _ours_fused(device, dtype, hf_config, compile=False):
    """Ours with `train.fused_linear_cross_entropy: on`: each token's nll from the fused
    linear + cross-entropy op, no logits."""
    return _ours(device, dtype, hf_config, compile, fused=True)


def _ours(device, dtype, hf_config, compile=False, fused=False):
    import mindspeed_ops
    from mindspeed_core.optim import build_optimizers
    from mindspeed_core.parallel import apply_compile
    from mindspeed_llm.models import build_model_config, get_model_spec

    config = build_model_config("llama", hf_config=hf_config)
    model = get_model_spec("llama").build(config).to(device)
    if compile:
        apply_compile(model, varying={"cu_seqlens": 0})  # as `train.compile` does
    optimizer = build_optimizers(model, lr=1e-4, weight_decay=0.1)

    def loss(tokens, labels, cu_seqlens, position_ids):
        if fused:
            nll = model(tokens, position_ids=position_ids, cu_seqlens=cu_seqlens, nll_labels=labels)
            return nll.mean()
        logits = model(tokens, position_ids=position_ids, cu_seqlens=cu_seqlens)
        return mindspeed_ops.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return model, _step(optimizer, device, dtype, loss)


def _theirs(device, dtype, hf_config, compile=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    model.train()

    def loss(tokens, labels, cu_seqlens, position_ids):
        # transformers shifts labels itself: the usual call passes the inputs as labels.
        return model(input_ids=tokens, labels=tokens, position_ids=position_ids).loss

    return model, _step(_adamw(model), device, dtype, loss)


def _torchtitan(device, dtype, hf_config, compile=False):
    """torchtitan's Llama 3 model (pip install torchtitan) with the same shape, the same loop.
    Differences it brings: no tied embeddings (a separate output matrix), and full causal
    attention over the row (its document masks need FlexAttention)."""
    import torch

    try:  # the module layout moved between torchtitan releases
        from torchtitan.models.llama3 import Transformer
        from torchtitan.models.llama3 import TransformerModelArgs as Args
    except ImportError:
        from torchtitan.models.llama import ModelArgs as Args
        from torchtitan.models.llama import Transformer

    dim, ffn = hf_config["hidden_size"], hf_config["intermediate_size"]
    base = int(2 * 4 * dim / 3)  # torchtitan's FFN width rule, steered onto `ffn`
    args = Args(
        dim=dim, n_layers=hf_config["num_hidden_layers"], n_heads=hf_config["num_attention_heads"],
        n_kv_heads=hf_config["num_key_value_heads"], vocab_size=hf_config["vocab_size"],
        multiple_of=ffn, ffn_dim_multiplier=ffn / base, norm_eps=hf_config["rms_norm_eps"],
        rope_theta=hf_config["rope_theta"], max_seq_len=hf_config["max_position_embeddings"],
    )  # fmt: skip
    with torch.device(device):
        model = Transformer(args)
        model.init_weights()
    if compile:  # torchtitan's own way: each block compiled as one graph, in place
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, fullgraph=True))

    def loss(tokens, labels, cu_seqlens, position_ids):
        logits = model(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return model, _step(_adamw(model), device, dtype, loss)


def _adamw(model):
    """The peers' optimizer, as ours: AdamW, weight decay on matrices only."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4, betas=(0.9, 0.95),
    )  # fmt: skip


def _step(optimizer, device, dtype, loss_of):
    """One training step: the loss under autocast, backward, optimizer step."""

    def step(tokens, labels, cu_seqlens, position_ids):
        with torch_autocast(device, dtype):
            loss = loss_of(tokens, labels, cu_seqlens, position_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def torch_autocast(device, dtype):
    import contextlib

    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _documents(micro_batch: int, seq: int, docs: int, device):
    """cu_seqlens over the flattened rows and per-row position ids restarting at each document
    (None, None for one document per row)."""
    import torch

    from mindspeed_ops.validate import remember_host_values

    if docs == 1:
        return None, None
    doc = seq // docs
    bounds = list(range(0, micro_batch * seq + 1, doc))
    # as the trainer's batches: the boundaries' values known on the host (no device read)
    cu = remember_host_values(torch.tensor(bounds, dtype=torch.int32, device=device), bounds)
    positions = (torch.arange(seq, device=device) % doc).expand(micro_batch, seq)
    return cu, positions


def run_side(side: str, dtype_name: str, steps: int, device_name: str, shape: str, seq: int,
             docs: int, compile: bool = False) -> dict:  # fmt: skip
    import torch

    from mindspeed_core import device as dev
    from mindspeed_core.training import dense_params, flops_per_token

    hf_config, _, micro_batch, _ = SHAPES[shape]
    device = torch.device(device_name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    data = torch.randint(0, hf_config["vocab_size"], (steps + 1, micro_batch, seq + 1))
    cu_seqlens, position_ids = _documents(micro_batch, seq, docs, device)
    baseline = _rss_mb() if device.type == "cpu" else 0.0
    builder = {"ours": _ours, "ours-fused": _ours_fused, "transformers": _theirs,
               "torchtitan": _torchtitan}[side]  # fmt: skip
    model, step = builder(device, dtype, hf_config, compile)
    n = dense_params(model)
    # Attention FLOPs of one document's length (what both sides compute with packing).
    flops = flops_per_token(n, hf_config["num_hidden_layers"], hf_config["hidden_size"],
                            seq // docs)  # fmt: skip
    losses, times = [], []
    for i in range(steps + 1):  # the first step warms up (allocator, kernels)
        batch = data[i].to(device)
        dev.synchronize(device)
        start = time.perf_counter()
        loss = step(batch[:, :-1], batch[:, 1:], cu_seqlens, position_ids)
        dev.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    seconds = sum(times[1:]) / steps
    return {
        "tokens_per_s": round(micro_batch * seq / seconds, 1),
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
    parser.add_argument("--shape", default="headline", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, help="tokens per row (default: the shape's)")
    parser.add_argument("--docs", type=int, help="packed documents per row (default: the shape's)")
    parser.add_argument("--dtypes", "--dtype", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="compile our blocks")
    parser.add_argument("--sides", default="ours,transformers",
                        help="any of ours, ours-fused, transformers, torchtitan")  # fmt: skip
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side
    args = parser.parse_args()
    hf_config, default_seq, micro_batch, default_docs = SHAPES[args.shape]
    seq, docs = args.seq or default_seq, args.docs or default_docs
    if args.side:
        result = run_side(args.side, args.dtypes, args.steps, args.device, args.shape, seq, docs,
                          args.compile)  # fmt: skip
        print(json.dumps(result))
        return
    for dtype in args.dtypes.split(","):
        result = {"bench": "train_step", "shape": args.shape, "seq": seq, "micro_batch":
                  micro_batch, "docs_per_row": docs}  # fmt: skip
        result.update(dtype=dtype, device=args.device, compile=args.compile, cpu=_cpu_model())
        sides = args.sides.split(",")
        for side in sides:
            cmd = [sys.executable, __file__, "--side", side, "--dtypes", dtype]
            cmd += ["--steps", str(args.steps), "--device", args.device, "--shape", args.shape]
            cmd += ["--seq", str(seq), "--docs", str(docs)]
            # compiled: ours (apply_compile) and torchtitan (its per-block compile);
            # transformers stays eager (its documented training call)
            cmd += ["--compile"] if args.compile and side != "transformers" else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                result[side] = {"failed": _error_line(out.stderr)}
                continue
            result[side] = json.loads(out.stdout.strip().splitlines()[-1])
        peak = _peak_flops(args.device, dtype)  # one measurement for both sides
        measured = [result[s] for s in sides if "tokens_per_s" in result[s]]
        for side in measured:
            side["mfu"] = round(side["tokens_per_s"] * side.pop("flops_per_token") / peak, 4)
        ours = result.get("ours", {})
        for peer in ("transformers", "torchtitan"):
            theirs = result.get(peer, {})
            if "tokens_per_s" in ours and "tokens_per_s" in theirs:
                suffix = "" if peer == "transformers" else "_vs_torchtitan"
                result["speedup" + suffix] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
                result["memory_ratio" + suffix] = round(
                    ours["peak_mem_mb"] / theirs["peak_mem_mb"], 3
                )
        fused = result.get("ours-fused", {})
        if "tokens_per_s" in ours and "tokens_per_s" in fused:  # the fused loss against ours
            result["fused_speed"] = round(fused["tokens_per_s"] / ours["tokens_per_s"], 3)
            result["fused_memory"] = round(fused["peak_mem_mb"] / ours["peak_mem_mb"], 3)
        print(json.dumps(result), flush=True)


def _error_line(stderr: str) -> str:
    """The exception's own line from a failed side's stderr (torch.compile's errors end in a
    hint about verbose logs, not in the error)."""
    lines = stderr.strip().splitlines() or ["(no output)"]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Unsupported)\b", line)]
    return (errors[-1] if errors else lines[-1])[:400]


def _cpu_model() -> str:
    from mindspeed_core import device as dev

    return dev.device_name("cpu")


if __name__ == "__main__":
    main()
