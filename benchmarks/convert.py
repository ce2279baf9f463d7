"""Memory and time of `mindspeed convert` on a ~1B-parameter model: HF -> MindSpeed -> HF.

    python benchmarks/convert.py [--dir /tmp/convert-bench] [--max-shard-size 1GB] [--keep]

Writes a random Llama with Llama-3.2-1B's shape (1.24B parameters, bf16, tied
embeddings: the largest tensor is the 128256 x 2048 embedding, 501 MiB) as sharded
safetensors, one tensor at a time, then runs each conversion in its own subprocess and
reads the child's peak resident memory (VmHWM). A no-op child (Python, torch and our
imports, nothing converted) gives the fixed overhead of the process. The goal: peak
minus overhead below 2x the largest tensor. The round trip is checked bit for bit.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_model(folder: Path, max_shard_size: int) -> dict:
    """The random model as HF safetensors shards, one tensor in memory at a time."""
    import torch

    from mindspeed_core.checkpoint.safetensors import SafetensorsWriter
    from mindspeed_llm.models import TransformerConfig
    from mindspeed_llm.models.common import hf_adapter
    from mindspeed_llm.models.hf_io import INDEX_FILE
    from mindspeed_tools.convert import plan_shards

    folder.mkdir(parents=True)
    config = TransformerConfig.from_hf(CONFIG)
    with torch.device("meta"):
        from mindspeed_llm.models import Transformer

        meta = Transformer(config).state_dict()
    hf_meta = hf_adapter.to_hf(meta, config)
    entries = [(name, torch.bfloat16, tuple(t.shape)) for name, t in hf_meta.items()]
    shards = plan_shards(entries, max_shard_size)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for file, names in shards.items():
        mine = [e for e in entries if e[0] in set(names)]
        writer = SafetensorsWriter(folder / file, mine)
        for name, dtype, shape in mine:
            tensor = torch.empty(shape, dtype=dtype)
            if "norm" in name:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0, 0.02, generator=gen)
            writer.write(name, tensor)
            weight_map[name] = file
        writer.close()
        total += writer.size
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    largest = max(torch.Size(s).numel() * d.itemsize for _, d, s in entries)
    params = sum(torch.Size(s).numel() for _, _, s in entries)
    return {"params": params, "bytes": total, "largest_tensor_bytes": largest, "files": len(shards)}


def _child(mode: str, args: list[str]) -> None:
    """Run one conversion (or nothing) and print wall time and peak RSS."""
    import torch  # noqa: F401  (the overhead includes torch, as in every conversion)

    from mindspeed_tools import convert

    start = time.perf_counter()
    if mode == "hf2ours":
        convert.hf_to_mindspeed(args[0], args[1])
    elif mode == "ours2hf":
        convert.mindspeed_to_hf(args[0], args[1], max_shard_size=int(args[2]))
    elif mode == "compare":
        from mindspeed_core.checkpoint.safetensors import read_tensor
        from mindspeed_llm.models.hf_io import hf_tensor_index

        a, b = hf_tensor_index(args[0]), hf_tensor_index(args[1])
        same = a.keys() == b.keys() and all(
            torch.equal(read_tensor(a[n]), read_tensor(b[n])) for n in a
        )
        print(json.dumps({"identical": same}))
        return
    print(json.dumps({"wall_s": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb()}))


def _run_child(mode: str, *args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/convert-bench"))
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1:])
        return
    from mindspeed_tools.convert import parse_size

    shard = parse_size(args.max_shard_size)
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, ours, back = args.dir / "hf", args.dir / "ours", args.dir / "back"
    start = time.perf_counter()
    model = write_model(hf, shard)
    model["write_s"] = time.perf_counter() - start
    noop = _run_child("noop")
    to_ours = _run_child("hf2ours", hf, ours)
    to_hf = _run_child("ours2hf", ours, back, shard)
    identical = _run_child("compare", hf, back)["identical"]
    largest_mb = model["largest_tensor_bytes"] / 2**20
    result = {
        "model": {**model, "largest_tensor_mb": largest_mb},
        "overhead_rss_mb": noop["peak_rss_mb"],
        "round_trip_identical": identical,
    }
    for name, run in (("hf_to_mindspeed", to_ours), ("mindspeed_to_hf", to_hf)):
        above = run["peak_rss_mb"] - noop["peak_rss_mb"]
        result[name] = {
            **run,
            "peak_above_overhead_mb": above,
            "x_largest_tensor": above / largest_mb,
            "gb_per_s": model["bytes"] / 1e9 / run["wall_s"],
        }
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
