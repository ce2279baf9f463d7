"""mindspeed-ops against the PyTorch reference: forward+backward time and peak memory.

    python benchmarks/ops.py [--ops rms_norm,swiglu] [--dtypes fp32,bf16] [--device cpu]

Prints one JSON line per op and dtype: our kernel (impl=<device>) against the reference in
eager mode and against torch.compile of the reference, all in this process. Shapes are those
of a 1B-class decoder (Llama-3.2-1B: hidden 2048, ffn 8192, 32 heads / 8 kv heads of 64, vocab
cut to 32k) with the token count cut to fit a small CPU. The `linear_decode*` cases are forward-only
inference products of one or 32 token rows, as in a decode step (the few-row CPU kernel).
The `gated_delta_rule*` cases (Qwen3-Next's linear attention; q, k, v with 4 heads of 64)
compare the chunked algorithm with the token-by-token reference; that reference is neither
compiled (torch.compile would unroll one step per token) nor profiled for memory (tens of
thousands of small ops and a state saved per token: a run that profiled it did not finish in
12 minutes on a shared 2-core machine), so its `ref_compile_ms` and `ref_peak_mb` are null.

Time: the fastest of several runs (at least 5, up to 2 s) of one forward+backward (the input gradients and, for losses, the
backward of the scalar loss), after warm-up. Peak memory: the largest amount of memory the
allocator holds during one forward+backward beyond what was allocated before it started
(outputs, saved activations, temporaries and the input gradients), read from the running
"Total Allocated" counter of torch.profiler's memory events on CPU, and from
torch.cuda.max_memory_allocated on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import mindspeed_ops as mo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 32, 8, 64, 32768


@dataclass
class Case:
    """One op at one shape: inputs (leaves that get gradients) and the two implementations."""

    op: str
    shape: str
    make: Callable[[torch.dtype, str], dict[str, torch.Tensor]]
    ours: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    backward: bool = True
    compile_reference: bool = True
    profile_reference: bool = True


def _randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()


def _cases(device: str, tokens: int) -> list[Case]:
    cos, sin = mo.rotary_tables(HEAD_DIM, 8192, device=device)
    vocab_target = torch.randint(0, VOCAB, (tokens,), device=device)
    # The fused loss at full hidden size is too many FLOPs for a small CPU; a narrow hidden keeps
    # the logits (tokens x vocab) the dominant tensor, as they are in a real model.
    lce_tokens, lce_hidden = tokens, HIDDEN // 8
    lce_target = vocab_target[:lce_tokens]
    experts = 8
    group_sizes = torch.full((experts,), tokens // experts, device=device)
    cu = torch.tensor([0, tokens // 3, tokens // 2, tokens], device=device)
    return [
        Case(
            "rms_norm", f"({tokens},{HIDDEN})",
            lambda dt, d: {"x": _randn(tokens, HIDDEN, dtype=dt, device=d),
                           "w": _randn(HIDDEN, dtype=dt, device=d)},
            lambda x, w: mo.rms_norm(x, w, impl=device),
            lambda x, w: mo.rms_norm_reference(x, w),
        ),
        Case(
            "swiglu", f"({tokens},2x{FFN})",
            lambda dt, d: {"x": _randn(tokens, 2 * FFN, dtype=dt, device=d)},
            lambda x: mo.swiglu(x, impl=device),
            mo.swiglu_reference,
        ),
        Case(
            "rotary_embedding", f"(1,{tokens},{HEADS},{HEAD_DIM})",
            lambda dt, d: {"q": _randn(1, tokens, HEADS, HEAD_DIM, dtype=dt, device=d)},
            lambda q: mo.rotary_embedding(q, cos, sin, impl=device),
            lambda q: mo.rotary_reference(
                q, cos, sin, torch.arange(tokens, device=device).expand(1, tokens)
            ),
        ),
        Case(
            "attention", f"causal q(1,{tokens},{HEADS},{HEAD_DIM}) kv {KV_HEADS} heads",
            lambda dt, d: {"q": _randn(1, tokens, HEADS, HEAD_DIM, dtype=dt, device=d),
                           "k": _randn(1, tokens, KV_HEADS, HEAD_DIM, dtype=dt, device=d),
                           "v": _randn(1, tokens, KV_HEADS, HEAD_DIM, dtype=dt, device=d)},
            lambda q, k, v: mo.attention(q, k, v, impl=device),
            lambda q, k, v: mo.attention_reference(q, k, v)[0],
        ),
        Case(
            "attention_packed_lse", f"3 packed seqs, {tokens} tokens, window 256, lse",
            lambda dt, d: {"q": _randn(tokens, HEADS, HEAD_DIM, dtype=dt, device=d),
                           "k": _randn(tokens, KV_HEADS, HEAD_DIM, dtype=dt, device=d),
                           "v": _randn(tokens, KV_HEADS, HEAD_DIM, dtype=dt, device=d)},
            lambda q, k, v: _sum_lse(mo.attention(q, k, v, cu_seqlens=cu, window=256,
                                                  return_lse=True, impl=device)),
            lambda q, k, v: _sum_lse(mo.attention_reference(q, k, v, cu_seqlens=cu,
                                                            window=256)),
        ),
        Case(
            "cross_entropy", f"({tokens},{VOCAB})",
            lambda dt, d: {"logits": _randn(tokens, VOCAB, dtype=dt, device=d)},
            lambda logits: mo.cross_entropy(logits, vocab_target, impl=device),
            lambda logits: mo.cross_entropy_reference(logits, vocab_target),
        ),
        Case(
            "linear_cross_entropy", f"h({lce_tokens},{lce_hidden}) W({VOCAB},{lce_hidden})",
            lambda dt, d: {"h": _randn(lce_tokens, lce_hidden, dtype=dt, device=d),
                           "w": _randn(VOCAB, lce_hidden, dtype=dt, device=d, scale=0.02)},
            lambda h, w: mo.linear_cross_entropy(h, w, lce_target, impl=device),
            lambda h, w: mo.linear_cross_entropy_reference(h, w, lce_target),
        ),
        Case(
            "grouped_matmul", f"{experts} experts, x({tokens},{HIDDEN // 2}) w(.,{HIDDEN // 2},{HIDDEN // 2})",
            lambda dt, d: {"x": _randn(tokens, HIDDEN // 2, dtype=dt, device=d),
                           "w": _randn(experts, HIDDEN // 2, HIDDEN // 2, dtype=dt, device=d)},
            lambda x, w: mo.grouped_matmul(x, w, group_sizes, impl=device),
            lambda x, w: mo.grouped_matmul_reference(x, w, group_sizes),
        ),
        *(_decode_case(name, rows, device) for name, rows in (("linear_decode", 1),
                                                               ("linear_decode_32rows", 32))),
        Case(
            "linear_decode_int8",
            f"x(1,{HIDDEN}) int8 W({FFN},{HIDDEN}) + scale; reference: PyTorch's int8 kernel",
            lambda dt, d: {"x": torch.randn(1, HIDDEN, device=d).to(dt),
                           "w": torch.randint(-127, 128, (FFN, HIDDEN), device=d).to(torch.int8),
                           "scale": torch.rand(FFN, device=d) / 127},
            lambda x, w, scale: mo.linear(x, w, scale=scale, impl=device),
            _int8_reference,
            backward=False,
        ),
        *(_delta_case(tokens, device, backward) for backward in (True, False)),
        Case(
            "matmul_add", f"dy({tokens},{HIDDEN}) x({tokens},{HIDDEN}) -> fp32 ({HIDDEN},{HIDDEN})",
            lambda dt, d: {"dy": torch.randn(tokens, HIDDEN, device=d).to(dt),
                           "x": torch.randn(tokens, HIDDEN, device=d).to(dt),
                           "main_grad": torch.zeros(HIDDEN, HIDDEN, device=d)},
            lambda dy, x, main_grad: mo.matmul_add(dy, x, main_grad, impl=device),
            lambda dy, x, main_grad: mo.matmul_add_reference(dy, x, main_grad),
            backward=False,
        ),
    ]  # fmt: skip


def _decode_case(name: str, rows: int, device: str) -> Case:
    """x (rows, HIDDEN) @ W (FFN, HIDDEN)^T with no gradient: a decode step's product."""
    return Case(
        name, f"x({rows},{HIDDEN}) W({FFN},{HIDDEN}), no grad",
        lambda dt, d: {"x": torch.randn(rows, HIDDEN, device=d).to(dt),
                       "w": torch.randn(FFN, HIDDEN, device=d).to(dt)},
        lambda x, w: mo.linear(x, w, impl=device),
        lambda x, w: mo.linear_reference(x, w),
        backward=False,
    )  # fmt: skip


def _delta_case(tokens: int, device: str, backward: bool) -> Case:
    """Gated delta rule over one sequence: q, k, v (1, tokens, 4, 64)."""
    heads_k, heads_v, dim = 4, 4, 64

    def make(dt, d):
        return {"q": _randn(1, tokens, heads_k, dim, dtype=dt, device=d),
                "k": _randn(1, tokens, heads_k, dim, dtype=dt, device=d),
                "v": _randn(1, tokens, heads_v, dim, dtype=dt, device=d),
                "g": (-torch.rand(1, tokens, heads_v, device=d)).requires_grad_(),
                "beta": torch.rand(1, tokens, heads_v, device=d).requires_grad_()}  # fmt: skip

    return Case(
        "gated_delta_rule" + ("" if backward else "_fwd"),
        f"q,k(1,{tokens},{heads_k},{dim}) v(1,{tokens},{heads_v},{dim})"
        + ("" if backward else ", forward only"),
        make,
        lambda **t: mo.gated_delta_rule(**t, impl=device)[0],
        lambda **t: mo.gated_delta_rule_reference(**t)[0],
        backward=backward,
        compile_reference=False,
        profile_reference=False,
    )


def _int8_reference(x, w, scale):
    """PyTorch's weight-only int8 kernel where it runs (CPU), the dequantised GEMM elsewhere."""
    if x.device.type == "cpu":
        return torch._weight_int8pack_mm(x, w, scale.to(x.dtype))
    return mo.linear_reference(x, w, scale=scale)


def _sum_lse(pair):
    out, lse = pair
    return out.float().sum() + lse.sum()


def _step(fn, inputs, backward):
    for t in inputs.values():
        t.grad = None
    out = fn(**inputs)
    if backward:
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(torch.ones_like(out))


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, inputs, backward, device, min_reps=5, budget_s=2.0) -> float:
    for _ in range(2):
        _step(fn, inputs, backward)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        _sync(device)
        t0 = time.perf_counter()
        _step(fn, inputs, backward)
        _sync(device)
        times.append(time.perf_counter() - t0)
    # The minimum: on a shared machine it is the run least disturbed by other work.
    return 1e3 * min(times)


def peak_mb(fn, inputs, backward, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, inputs, backward)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    for t in inputs.values():
        t.grad = None  # so that freeing old gradients does not offset the count
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(fn, inputs, backward)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0.0
    # "Total Allocated" is the allocator's running total, including what lived before the step.
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return (max(m["Total Allocated"] for m in memory) - before) / 2**20


def bench(case: Case, dtype_name: str, device: str) -> dict[str, object]:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    inputs = case.make(dtype, device)
    ours_ms = time_ms(case.ours, inputs, case.backward, device)
    ref_ms = time_ms(case.reference, inputs, case.backward, device)
    compile_ms = None
    if case.compile_reference:
        compile_ms = time_ms(torch.compile(case.reference), inputs, case.backward, device)
    ours_mb = peak_mb(case.ours, inputs, case.backward, device)
    ref_mb = peak_mb(case.reference, inputs, case.backward, device) if case.profile_reference else None
    return {
        "op": case.op,
        "dtype": dtype_name,
        "shape": case.shape,
        "impl": device,
        "ours_ms": round(ours_ms, 3),
        "ref_eager_ms": round(ref_ms, 3),
        "ref_compile_ms": None if compile_ms is None else round(compile_ms, 3),
        "speedup_vs_eager": round(ref_ms / ours_ms, 2),
        "speedup_vs_compile": None if compile_ms is None else round(compile_ms / ours_ms, 2),
        "ours_peak_mb": round(ours_mb, 1),
        "ref_peak_mb": None if ref_mb is None else round(ref_mb, 1),
        "mem_ratio": round(ours_mb / ref_mb, 3) if ref_mb else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per batch")
    args = parser.parse_args()
    wanted = {o for o in args.ops.split(",") if o}
    for case in _cases(args.device, args.tokens):
        if wanted and case.op not in wanted:
            continue
        for dtype_name in args.dtypes.split(","):
            print(json.dumps(bench(case, dtype_name, args.device)), flush=True)


if __name__ == "__main__":
    main()
