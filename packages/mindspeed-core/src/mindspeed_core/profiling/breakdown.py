"""Compute vs communication vs idle time per step, and the top operators, from a chrome trace.

Reads what torch.profiler's `export_chrome_trace` writes (the JSON torch-tb-profiler parses
and Perfetto opens): complete events ("ph": "X") with `ts`/`dur` in microseconds, steps
marked by `ProfilerStep#N` annotations.

Within each step window [start, start + dur] of the thread that ran the steps:
- busy intervals come from the device timeline when the trace has one (CUDA/NPU kernels,
  memcpy, memset), else from the CPU operators of the step thread (`cpu_op` events;
  autograd's `evaluate_function` wrappers are left out so that a wait inside a backward
  hook is not counted as compute);
- communication intervals are collective kernels (nccl/hccl names) or collective CPU ops
  (`c10d::*`, `_c10d_functional::*`, `record_param_comms`) and, for gloo, the collectives
  its worker threads run (`gloo:*` annotations);
- compute = |union(compute)|, comm = |union(compute + comm)| - |union(compute)| (the
  communication not hidden behind compute), idle = step - |union(compute + comm)|.
So compute + comm + idle is the step time by construction; `comm_total_ms` also counts the
overlapped part. All times are reported in milliseconds.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from mindspeed_core.errors import DataError

_COMM_OP = re.compile(
    r"^(c10d::|_c10d_functional::|c10d_functional::|record_param_comms|gloo:|nccl:|hccl:)"
    r"|nccl|hccl|hcom_",
    re.IGNORECASE,
)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_WRAPPERS = ("autograd::engine::evaluate_function",)
Interval = tuple[float, float]
STEP_OFFSET_KEY = "mindspeed_step_offset"
"""Top-level trace key: run step of ProfilerStep#0 (torch counts from the profiler's start)."""


def load_trace(path: str | Path) -> dict:
    """The JSON of a `.pt.trace.json[.gz]` file.

    Raises:
        DataError: the file is missing or not a chrome trace.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except FileNotFoundError:
        raise DataError(f"trace {path} does not exist") from None
    except (OSError, ValueError, EOFError) as err:  # EOFError: a truncated .gz
        raise DataError(f"trace {path} is not a readable chrome trace: {err}") from None
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise DataError(f"trace {path} has no traceEvents: not a torch.profiler trace")
    events = data["traceEvents"]
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise DataError(f"trace {path}: traceEvents is not a list of events")
    return data


def union_length(intervals: list[Interval]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _complete_events(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _steps(events: list[dict]) -> list[dict]:
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    return sorted(steps, key=lambda e: e["ts"])


def _span(e: dict) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _is_comm(e: dict) -> bool:
    return bool(_COMM_OP.search(str(e.get("name", ""))))


def _intervals(events: list[dict], step: dict) -> tuple[list[Interval], list[Interval]]:
    """(compute, comm) busy intervals; device ones when the trace has a device timeline."""
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    if device:  # on accelerators the CPU ops only launch kernels
        return [_span(e) for e in device if not _is_comm(e)], [_span(e) for e in device if _is_comm(e)]
    comm = [
        _span(e)
        for e in events
        if _is_comm(e) and (e.get("cat") == "cpu_op" or str(e["name"]).startswith("gloo:"))
    ]
    compute = [
        _span(e)
        for e in events
        if e.get("cat") == "cpu_op"
        and e.get("tid") == step.get("tid")
        and not _is_comm(e)
        and not str(e["name"]).startswith(_WRAPPERS)
    ]
    return compute, comm


def step_breakdown(data: dict) -> list[dict]:
    """One row per profiled step: step, total_ms, compute_ms, comm_ms, idle_ms,
    comm_total_ms (see the module docstring)."""
    events = _complete_events(data)
    offset = int(data.get(STEP_OFFSET_KEY, 0))
    rows = []
    for step in _steps(events):
        lo, hi = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        compute, comm = (_clip(x, lo, hi) for x in _intervals(events, step))
        busy_compute = union_length(compute)
        busy = union_length(compute + comm)
        rows.append({
            "step": int(step["name"].split("#", 1)[1]) + offset,
            "total_ms": (hi - lo) / 1e3,
            "compute_ms": busy_compute / 1e3,
            "comm_ms": (busy - busy_compute) / 1e3,
            "idle_ms": (hi - lo - busy) / 1e3,
            "comm_total_ms": union_length(comm) / 1e3,
        })  # fmt: skip
    return rows


def top_operators(data: dict, k: int = 10) -> list[dict]:
    """The `k` operators with the most self time inside the profiled steps: device kernels
    when the trace has them, else CPU ops of the step thread. name, calls, self_ms."""
    events = _complete_events(data)
    steps = _steps(events)
    if not steps:
        return []
    lo, hi = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    inside = [e for e in events if lo <= e["ts"] < hi]
    device = [e for e in inside if e.get("cat") in _DEVICE_CATS]
    if device:
        selfs = [(e, float(e["dur"])) for e in device]
    else:
        ops = [e for e in inside if e.get("cat") == "cpu_op" and e.get("tid") == steps[0].get("tid")]
        selfs = _self_times(ops)
    calls, total = defaultdict(int), defaultdict(float)
    for e, t in selfs:
        calls[e["name"]] += 1
        total[e["name"]] += t
    ranked = sorted(total, key=total.get, reverse=True)[:k]
    return [{"name": n, "calls": calls[n], "self_ms": total[n] / 1e3} for n in ranked]


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """Each op's duration minus that of the ops nested directly inside it."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    selfs = {id(e): float(e["dur"]) for e in ops}
    stack: list[dict] = []
    for e in ops:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            selfs[id(stack[-1])] -= float(e["dur"])
        stack.append(e)
    return [(e, max(selfs[id(e)], 0.0)) for e in ops]


def summarize(path: str | Path, k: int = 10) -> dict:
    """{"trace", "rank", "steps": step_breakdown, "top_ops": top_operators} of one trace."""
    data = load_trace(path)
    rank = (data.get("distributedInfo") or {}).get("rank")
    if rank is None:
        match = re.match(r"rank(\d+)\.", Path(path).name)
        rank = int(match.group(1)) if match else 0
    return {
        "trace": str(path),
        "rank": rank,
        "steps": step_breakdown(data),
        "top_ops": top_operators(data, k),
    }


def format_table(summaries: list[dict]) -> str:
    """The per-rank, per-step table and each rank's top operators, as text."""
    head = f"{'rank':>4} {'step':>5} {'total ms':>10} {'compute ms':>11} {'comm ms':>9} {'idle ms':>9}  compute/comm/idle"
    lines = [head]
    for s in sorted(summaries, key=lambda s: s["rank"]):
        for r in s["steps"]:
            t = max(r["total_ms"], 1e-9)
            shares = "/".join(f"{100 * r[k] / t:.0f}%" for k in ("compute_ms", "comm_ms", "idle_ms"))
            lines.append(f"{s['rank']:>4} {r['step']:>5} {r['total_ms']:>10.2f} {r['compute_ms']:>11.2f} "
                         f"{r['comm_ms']:>9.2f} {r['idle_ms']:>9.2f}  {shares}")  # fmt: skip
    for s in sorted(summaries, key=lambda s: s["rank"]):
        lines += ["", f"rank {s['rank']}: top operators by self time ({s['trace']})"]
        lines += [f"  {o['self_ms']:>10.2f} ms {o['calls']:>6}x  {o['name']}" for o in s["top_ops"]]
    return "\n".join(lines)


def write_breakdown(trace: str | Path, stem: str | Path) -> dict:
    """Summarise `trace` into `<stem>.json` and `<stem>.txt`; returns the summary."""
    summary = summarize(trace)
    Path(f"{stem}.json").write_text(json.dumps(summary, indent=1))
    Path(f"{stem}.txt").write_text(format_table([summary]) + "\n")
    return summary


def find_traces(folder: str | Path) -> list[Path]:
    """The newest trace of each worker under `folder` (a run directory or a profile dir)."""
    folder = Path(folder)
    newest: dict[tuple[Path, str], Path] = {}
    for path in sorted(folder.rglob("*.pt.trace.json*")):
        worker = path.name.split(".", 1)[0]
        newest[(path.parent, worker)] = path  # sorted: the highest timestamp wins
    return sorted(newest.values())
