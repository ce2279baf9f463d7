"""Start-up: time and peak memory per rank to build a model and load its weights from a
Hugging Face safetensors folder, ours against transformers' `from_pretrained`.

    python benchmarks/startup.py [--dir /tmp/startup-bench] [--nproc 2] [--keep]

Writes a random Llama with Llama-3.2-1B's shape (1.24B parameters, bf16 shards, one tensor
at a time: `convert.py`'s writer), then runs each side in its own process and reads its
peak resident memory (VmHWM; every rank's under torchrun):

- `transformers`: `AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`, one process;
- `ours`: `build_model(..., hf_path=dir)` on one process (meta build, then each tensor
  read into the fp32 model);
- `ours_dp_shard{N}`: the same under `--parallel.dp_shard N` on N processes (each rank
  reads only its blocks; the bar: half the fp32 model plus the largest tensor at N=2);
- `torchtitan` (when installed): its meta-device path, `Transformer` on meta, `to_empty`,
  `init_weights` (no Hugging Face reader of its own to time; what its build costs).

A no-op child (Python, torch and our imports) gives the fixed overhead. Prints one JSON line
with each side's seconds and peak, and ours / transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import CONFIG, write_model  # noqa: E402  (the sibling benchmark's writer)


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(side: str, folder: str) -> None:
    import torch

    import mindspeed_llm.train.build  # noqa: F401  (the overhead includes our imports)

    start = time.perf_counter()
    if side == "transformers":
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    elif side == "ours":
        _ours(folder)
    elif side == "torchtitan":
        _torchtitan()
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb()}))


def _ours(folder: str) -> None:
    import torch
    import torch.distributed as dist

    from mindspeed_core.distributed import init_distributed
    from mindspeed_core.parallel import ParallelConfig
    from mindspeed_llm.models.hf_io import read_hf_config
    from mindspeed_llm.train.build import build_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_distributed(device_type="cpu")
    parallel = ParallelConfig(dp_shard=world)
    dims = parallel.dims(world).build("cpu")
    build_model(read_hf_config(folder), dims, torch.device("cpu"), parallel=parallel,
                seq_len=64, hf_path=Path(folder))  # fmt: skip
    if world > 1:
        peaks = [None] * world
        dist.all_gather_object(peaks, _peak_rss_mb())
        if dist.get_rank() != 0:
            sys.exit(0)
        print(json.dumps({"peak_rss_mb_per_rank": peaks}))


def _torchtitan() -> None:
    import torch

    try:
        from torchtitan.models.llama3 import Transformer
        from torchtitan.models.llama3 import TransformerModelArgs as Args
    except ImportError:
        return
    args = Args(dim=CONFIG["hidden_size"], n_layers=CONFIG["num_hidden_layers"],
                n_heads=CONFIG["num_attention_heads"], n_kv_heads=CONFIG["num_key_value_heads"],
                vocab_size=CONFIG["vocab_size"], rope_theta=CONFIG["rope_theta"])  # fmt: skip
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()


def _run(side: str, folder: Path, nproc: int = 1) -> dict:
    if nproc == 1:
        cmd = [sys.executable, __file__, "--child", side, str(folder)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", __file__, "--child", side, str(folder)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDSPEED_DEVICE": "cpu"}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{side}: {done.stderr[-3000:]}")
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    out = {k: v for line in lines for k, v in line.items()}
    if nproc > 1:
        out["seconds"] = time.perf_counter() - start  # the launch included
        out["peak_rss_mb"] = max(out["peak_rss_mb_per_rank"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/startup-bench"))
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the dp_shard side")
    parser.add_argument("--keep", action="store_true", help="keep the model folder")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    folder = args.dir / "hf"
    model = write_model(folder, 2 * 10**9)
    fp32_mb = model["params"] * 4 / 2**20
    largest_fp32_mb = model["largest_tensor_bytes"] * 2 / 2**20  # stored in bf16
    noop = _run("noop", folder)
    sides = {"transformers": _run("transformers", folder), "ours": _run("ours", folder)}
    sides[f"ours_dp_shard{args.nproc}"] = _run("ours", folder, args.nproc)
    titan = _run("torchtitan", folder)
    if titan["seconds"] > 0.5:  # 0: not installed
        sides["torchtitan_meta_init"] = titan
    for side in sides.values():
        side["peak_above_overhead_mb"] = side["peak_rss_mb"] - noop["peak_rss_mb"]
    theirs, ours = sides["transformers"], sides["ours"]
    sharded = sides[f"ours_dp_shard{args.nproc}"]
    bar = fp32_mb / args.nproc + largest_fp32_mb
    result = {
        "model": {**model, "fp32_mb": fp32_mb, "largest_tensor_fp32_mb": largest_fp32_mb},
        "overhead_rss_mb": noop["peak_rss_mb"],
        "sides": sides,
        "ours_vs_transformers_seconds": ours["seconds"] / theirs["seconds"],
        "ours_vs_transformers_peak": ours["peak_above_overhead_mb"]
        / theirs["peak_above_overhead_mb"],
        f"dp_shard{args.nproc}_peak_above_overhead_vs_bar": sharded["peak_above_overhead_mb"] / bar,
    }
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
