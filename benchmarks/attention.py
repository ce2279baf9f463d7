"""Packed attention at long sequence lengths: our kernel vs the previous op vs torch's SDPA.

    python benchmarks/attention.py [--seqs 4096,16384,32768] [--docs 1,8] [--dtype bf16]
                                   [--device cpu] [--repeat 2]

One forward+backward of causal attention, 8 query / 2 kv heads of 64, over `seq` tokens packed
as `docs` equal documents:
- "ours": `mindspeed_ops.attention` as the trainers call it (packed, with the lse), on its
  device's kernel (CPU: our C++ flash kernel; CUDA: varlen flash);
- "previous": the op as it was before (one document at a time, each document's fp32 score
  matrix in forward and backward: the "composed" kernel, still there as the last fallback);
- "sdpa": `torch.nn.functional.scaled_dot_product_attention` on one document (the CPU flash
  kernel on CPU, flash/cuDNN on CUDA; no packing, no lse), the bar.

Each case runs in its own process, so its memory reading is clean: peak memory growth is the
peak resident set (CPU; ru_maxrss) or peak allocated memory (CUDA) during one forward+backward
minus what the process held just before it (inputs allocated, kernels loaded and warmed on a
small case). Time is the fastest of `--repeat` runs after that first one. A case whose
(tokens x tokens) matrices would not fit in memory reports "does not fit" instead of running
(the previous op at 16k+ on a 24 GiB machine). Prints one JSON line per case, then a summary
line with the ratios the F2 issue asks about.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _case(impl: str, seq: int, docs: int, dtype_name: str, device_name: str, repeat: int):
    import torch
    import torch.nn.functional as F

    import mindspeed_ops as mo
    from mindspeed_ops import attention_kernels as kernels

    device = torch.device(device_name)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    torch.manual_seed(0)
    doc = seq // docs
    cu = torch.arange(0, seq + 1, doc, dtype=torch.int32, device=device)

    def leaves(tokens):
        return [
            torch.randn(tokens, h, HEAD_DIM, device=device, dtype=dtype).requires_grad_()
            for h in (HEADS, KV_HEADS, KV_HEADS)
        ]

    def run(q, k, v, cu_seqlens):
        if impl == "sdpa":
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()
            return
        if impl == "ours":
            out, _ = mo.attention(q, k, v, cu_seqlens=cu_seqlens, return_lse=True)
            out.sum().backward()
            return
        scale = HEAD_DIM**-0.5
        args = (cu_seqlens, cu_seqlens, None, True, kernels.NO_WINDOW, 0.0, scale)
        with torch.no_grad():
            out, lse = kernels.forward("composed", q, k, v, *args)
            kernels.backward("composed", torch.ones_like(out), None, q, k, v, out, lse, *args)

    def sync():
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)

    small = leaves(256)
    run(*small, torch.tensor([0, 256], dtype=torch.int32, device=device))  # load and warm up
    del small
    q, k, v = leaves(seq)
    sync()
    if device.type == "cpu":
        before = _rss_bytes()
    else:
        module = torch.get_device_module(device.type)
        module.reset_peak_memory_stats(device)
        before = module.memory_allocated(device)
    start = time.perf_counter()
    run(q, k, v, cu)
    sync()
    times = [time.perf_counter() - start]
    if device.type == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    else:
        peak = torch.get_device_module(device.type).max_memory_allocated(device) - before
    for _ in range(repeat - 1):
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        run(q, k, v, cu)
        sync()
        times.append(time.perf_counter() - start)
    return {"seconds": round(min(times), 4), "peak_growth_gib": round(peak / 2**30, 4)}


def _fits(impl: str, seq: int, docs: int, device: str) -> bool:
    """Whether the previous op's fp32 score matrices (scores, probabilities and their
    gradient: three of them in backward) fit in the device's free memory."""
    if impl != "previous":
        return True
    doc = seq // docs
    if device == "cpu":
        free = _available_bytes()
    else:
        import torch

        free = torch.get_device_module(device.split(":")[0]).mem_get_info()[0]
    return 3 * HEADS * doc * doc * 4 < 0.8 * free


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384,32768")
    parser.add_argument("--docs", default="1,8")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--impls", default="ours,previous,sdpa")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case
    args = parser.parse_args(argv)
    if args.case:
        impl, seq, docs = args.case.split(":")
        result = _case(impl, int(seq), int(docs), args.dtype, args.device, args.repeat)
        print(json.dumps(result))
        return
    rows = []
    for seq in map(int, args.seqs.split(",")):
        for docs in map(int, args.docs.split(",")):
            for impl in args.impls.split(","):
                if impl == "sdpa" and docs != 1:
                    continue  # SDPA takes no packed documents
                row = {"impl": impl, "seq": seq, "docs": docs, "dtype": args.dtype,
                       "device": args.device}  # fmt: skip
                if not _fits(impl, seq, docs, args.device):
                    row["result"] = "does not fit"
                else:
                    command = [sys.executable, __file__, "--case", f"{impl}:{seq}:{docs}",
                               "--dtype", args.dtype, "--device", args.device,
                               "--repeat", str(args.repeat)]  # fmt: skip
                    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
                    if done.returncode:
                        row["result"] = "failed: " + done.stderr.strip().splitlines()[-1][:200]
                    else:
                        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(json.dumps({"summary": _summary(rows)}), flush=True)


def _summary(rows) -> dict:
    found = {(r["impl"], r["seq"], r["docs"]): r for r in rows if "seconds" in r}
    summary = {}
    for seq in sorted({r["seq"] for r in rows}):
        ours, sdpa = found.get(("ours", seq, 1)), found.get(("sdpa", seq, 1))
        entry = {}
        if ours and sdpa:
            entry["ours_vs_sdpa_time"] = round(ours["seconds"] / sdpa["seconds"], 3)
            entry["ours_vs_sdpa_memory"] = round(
                ours["peak_growth_gib"] / max(sdpa["peak_growth_gib"], 1e-6), 3
            )
        packed = found.get(("ours", seq, 8))
        if ours and packed:
            entry["ours_8docs_vs_1doc_time"] = round(packed["seconds"] / ours["seconds"], 3)
        previous = found.get(("previous", seq, 1))
        if ours and previous:
            entry["previous_vs_ours_time"] = round(previous["seconds"] / ours["seconds"], 3)
            entry["previous_vs_ours_memory"] = round(
                previous["peak_growth_gib"] / max(ours["peak_growth_gib"], 1e-6), 3
            )
        summary[str(seq)] = entry
    return summary


if __name__ == "__main__":
    main()
