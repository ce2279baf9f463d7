"""Host time of one training step with the device work removed: ours against transformers.

    python benchmarks/host_overhead.py [--shapes llama-1b,smollm-135m] [--kernels cuda|cpu]
        [--steps 5] [--repeat 2] [--docs N] [--sides ours,transformers]

An accelerator runs a step as fast as its host can queue the kernels, and no faster: when the
Python, dispatch and autograd work per op takes longer than the kernels, the step is as long as
the host's part. This script measures that part on any machine. Both sides build the same Llama
(`train_throughput.py`'s shapes: Llama-3.2-1B, SmolLM-135M; bf16 autocast over fp32 weights,
seq 4096, 8 packed documents a row) under torch's FakeTensorMode, whose tensors carry shapes and
dtypes but no data: every op is dispatched, checked and differentiated as usual, and no kernel
computes anything. One step is the forward, the loss, the backward, torch's fused AdamW step
and zero_grad, as `train_throughput.py` times them on a device.

`--kernels cuda` (default): the kernels our CUDA path chooses (mindspeed_ops' `impl="cuda"`,
traced on the fake tensors: varlen flash attention, the composed norms, the chunked cross
entropy at its accelerator chunk size; liger-kernel where installed is not traced). Our custom
ops are counted with the aten ops their bodies run, as the device would launch them.
`--kernels cpu`: the CPU path (our C++ kernels, each one op). transformers runs its own SDPA
path either way (its block-diagonal mask from the packed position ids).

Reported per side: `host_s`, the CPU seconds of the process for one step, the fastest of
`--steps` steps after a warm-up in the fastest of `--repeat` processes (CPU time, as the H200
profile counted it, and the fastest step: what other load on a shared machine disturbed least;
`host_s_median` and the wall-clock `wall_s` beside it; the fake kernels cost some
microseconds per op, so absolute seconds are higher than on a device's host: the ratio is the
figure); `ops`, the ops dispatched in one step (aten and custom ops, what
a TorchDispatchMode sees, without the `prim.*` queries only tensor subclasses make); and the
most frequent ops. A host read of a tensor value (`.item()`, `.tolist()`, data-dependent
shapes: a sync on an accelerator) fails a fake step, so a side that completes makes none.
Prints one JSON line per shape with both sides and the ratios (ours / transformers).

Eager steps only: torch.compile does not run under an outer FakeTensorMode (it fakes tensors
itself), so the compiled step's host time is measured on the device
(`train_throughput.py --compile` in `device_suite.sh`).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import SHAPES, _cpu_model  # noqa: E402


def _counter():
    """A TorchDispatchMode counting ops; with `expand`, our custom ops run their bodies (whose
    aten ops are counted too) instead of their fake kernels."""
    import torch
    from torch._library.custom_ops import _maybe_get_opdef
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self, expand: bool):
            super().__init__()
            self.expand = expand
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            if func.namespace == "prim":  # device/layout queries of tensor subclasses
                return func(*args, **kwargs)
            self.ops[name] += 1
            opdef = _maybe_get_opdef(func._name) if func.namespace == "mindspeed" else None
            if self.expand and opdef is not None:
                with self:  # the body's aten ops, counted and faked as the device runs them
                    return opdef._init_fn(*args, **kwargs)
            return func(*args, **kwargs)

    return Count, torch


def _documents(micro_batch: int, seq: int, docs: int):
    import torch

    from mindspeed_ops.validate import remember_host_values

    doc = seq // docs
    bounds = list(range(0, micro_batch * seq + 1, doc))
    cu = remember_host_values(torch.tensor(bounds, dtype=torch.int32), bounds)
    positions = (torch.arange(seq) % doc).expand(micro_batch, seq)
    return cu, positions


def _ours(hf_config: dict, kernels: str):
    import torch

    import mindspeed_ops
    from mindspeed_core.optim import build_optimizers
    from mindspeed_llm.models import build_model_config, get_model_spec

    config = build_model_config("llama", hf_config=hf_config, ops_impl=kernels)
    model = get_model_spec("llama").build(config)
    optimizer = build_optimizers(model, lr=1e-4, weight_decay=0.1, implementation="fused")

    def loss(tokens, labels, cu_seqlens, position_ids):
        logits = model(tokens, position_ids=position_ids, cu_seqlens=cu_seqlens)
        return mindspeed_ops.cross_entropy(logits.flatten(0, 1), labels.flatten(), impl=kernels)

    return torch, optimizer, loss


def _theirs(hf_config: dict, kernels: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip

    def loss(tokens, labels, cu_seqlens, position_ids):
        return model(input_ids=tokens, labels=labels, position_ids=position_ids).loss

    return torch, optimizer, loss


def run_side(side: str, shape: str, kernels: str, steps: int, docs: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    hf_config, seq, micro_batch, default_docs = SHAPES[shape]
    docs = docs or default_docs
    Count, _ = _counter()
    build = {"ours": _ours, "transformers": _theirs}[side]
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        _, optimizer, loss_of = build(hf_config, kernels)
        tokens = torch.randint(0, hf_config["vocab_size"], (micro_batch, seq))
        cu_seqlens, position_ids = _documents(micro_batch, seq, docs)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(tokens, tokens, cu_seqlens, position_ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        expand = kernels == "cuda" and side == "ours"
        # Our custom ops run their bodies in every timed step too, under the same counting
        # mode on both sides (the mode's own cost per op is the same for both).
        with Count(expand) as count:
            step()  # warm-up: optimizer state, caches
        cpu_times, wall_times = [], []
        for _ in range(steps):
            with Count(expand) as count:
                start, wall = time.process_time(), time.perf_counter()
                step()
                cpu_times.append(time.process_time() - start)
                wall_times.append(time.perf_counter() - wall)
    total = sum(count.ops.values())
    custom = sum(n for name, n in count.ops.items() if name.startswith("mindspeed."))
    return {
        "host_s": round(min(cpu_times), 4),
        "host_s_median": round(statistics.median(cpu_times), 4),
        "wall_s": round(min(wall_times), 4),
        "ops": total,
        "custom_ops": custom,
        "top_ops": dict(count.ops.most_common(12)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,smollm-135m")
    parser.add_argument("--kernels", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2, help="processes per side")
    parser.add_argument("--docs", type=int, help="packed documents per row (default: the shape's)")
    parser.add_argument("--sides", default="ours,transformers")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: one side, one shape
    args = parser.parse_args()
    if args.side:
        result = run_side(args.side, args.shapes, args.kernels, args.steps, args.docs)
        print(json.dumps(result))
        return
    import subprocess

    from train_throughput import _error_line

    for shape in args.shapes.split(","):
        _, seq, micro_batch, docs = SHAPES[shape]
        result = {"bench": "host_overhead", "shape": shape, "seq": seq, "micro_batch": micro_batch,
                  "docs_per_row": args.docs or docs, "dtype": "bf16", "kernels": args.kernels,
                  "cpu": _cpu_model()}  # fmt: skip
        sides = args.sides.split(",")
        for _ in range(args.repeat):  # the sides alternate; each keeps its fastest process
            for side in sides:
                # Each side in a process of its own: neither warms the other's caches.
                cmd = [sys.executable, __file__, "--side", side, "--shapes", shape,
                       "--kernels", args.kernels, "--steps", str(args.steps)]  # fmt: skip
                cmd += ["--docs", str(args.docs)] if args.docs else []
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    result[side] = {"failed": _error_line(out.stderr)}
                    continue
                run = json.loads(out.stdout.strip().splitlines()[-1])
                if run["host_s"] < result.get(side, {}).get("host_s", float("inf")):
                    result[side] = run
        ours, theirs = result.get("ours", {}), result.get("transformers", {})
        if "host_s" in ours and "host_s" in theirs:
            result["host_ratio"] = round(ours["host_s"] / theirs["host_s"], 3)
            result["ops_ratio"] = round(ours["ops"] / theirs["ops"], 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
