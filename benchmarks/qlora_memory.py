"""QLoRA's base memory and the NF4 op's speed, measured in one run.

    uv run python benchmarks/qlora_memory.py [--hidden 1024 --layers 4]

Prints one JSON line per case:
- "base_bytes": bytes the decoder linear weights hold in NF4 (codes + fp32 absmax, as
  `mindspeed_llm.peft.qlora.quantize_base` stores them) against the same weights in bf16;
  goal ratio <= 0.3.
- "nf4_quantize" / "nf4_dequantize": the C++ CPU kernel against the PyTorch reference on one
  weight (median of runs), ratio = reference time / kernel time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import mindspeed_ops as mo
from mindspeed_llm.models import Transformer, build_model_config
from mindspeed_llm.peft import LoRAConfig, apply_lora
from mindspeed_llm.peft.qlora import base_weight_bytes, quantize_base


def _median_s(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    base = build_model_config("llama", flavor="debug", ops_impl="reference")
    config = dataclasses.replace(base, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                 num_layers=args.layers, head_dim=args.hidden // base.num_heads)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p_ in model.parameters():
            p_.normal_(0, 0.02)
    apply_lora(model, LoRAConfig(rank=16))
    quantize_base(model)
    stored, bf16 = base_weight_bytes(model)
    print(json.dumps({"case": "base_bytes", "nf4_bytes": stored, "bf16_bytes": bf16,
                      "ratio": round(stored / bf16, 4), "goal": "<= 0.3",
                      "met": stored / bf16 <= 0.3}))  # fmt: skip
    w = torch.randn(4 * args.hidden, args.hidden).bfloat16()
    packed, absmax = mo.nf4_quantize(w)
    cases = {
        "nf4_quantize": (lambda: mo.nf4_quantize(w, impl="cpu"),
                         lambda: mo.nf4_quantize_reference(w)),
        "nf4_dequantize": (lambda: mo.nf4_dequantize(packed, absmax, w.shape, impl="cpu"),
                           lambda: mo.nf4_dequantize_reference(packed, absmax, w.shape)),
    }  # fmt: skip
    for name, (ours, reference) in cases.items():
        t_ours, t_ref = _median_s(ours), _median_s(reference)
        print(json.dumps({"case": name, "shape": list(w.shape), "cpp_ms": round(t_ours * 1e3, 3),
                          "reference_ms": round(t_ref * 1e3, 3),
                          "ratio": round(t_ref / t_ours, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
