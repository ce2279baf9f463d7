"""Decode speed of our generation engine against transformers' `generate`, same weights.

    python benchmarks/generate.py [--configs headline,small] [--batches 1,8,32]
                                  [--variants fp32,bf16,int8] [--threads N]

One process builds a random Llama in transformers, copies its weights into ours, and
times greedy generation of both from the same 32-token prompts, fp32: ours is
`mindspeed_llm.generation.generate` (preallocated KV cache), theirs is the documented
`model.generate(do_sample=False)` (SDPA attention, its default dynamic cache). Configs:
"headline" (vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads, 4 kv heads:
on CPU a decode step is bound by reading the fp32 weights) and "small" (the tests' tiny
Llama, vocab 512, hidden 64, 2 layers: bound by per-step overhead).

Decode tokens/s = batch * (N - 1) / (time for N new tokens - time for 1 new token), so
the prefill is left out; each time is the median of `--repeats` runs after a warm-up,
measured as wall-clock time and as this process's CPU time (steadier on a shared machine).
Both sides must produce the same tokens in fp32. Variants of our side: `bf16` (weights and
compute in bf16; transformers in bf16 too) and `int8` (our weight-only int8 linear layers,
`mindspeed_llm.generation.quantize`, against transformers in fp32); their greedy tokens'
agreement with our fp32 tokens is reported, not required. At batch 1 a decode step reads
every weight once, so the benchmark also measures the machine's read bandwidth (a sum over
1 GiB) and prints the weight-streaming limit: bandwidth / bytes of weights per token.
Prints one JSON line per config, variant and batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from train_throughput import HEADLINE as TRAIN_HEADLINE  # the same model as the training one

CONFIGS = {}
CONFIGS["headline"] = HEADLINE = {k: v for k, v in TRAIN_HEADLINE.items() if k != "model_type"}
CONFIGS["small"] = {
    **HEADLINE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPT_LEN = 32


def _models(device, hf_config: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.models import Transformer, TransformerConfig
    from mindspeed_llm.models.common import hf_adapter

    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config)).to(device).eval()
    config = TransformerConfig.from_hf(theirs.config.to_dict())
    ours = Transformer(config).to(device).eval()
    ours.load_state_dict(hf_adapter.from_hf(theirs.state_dict(), config))
    return ours, theirs


def _variant(ours, theirs, variant: str):
    """(our model, their model) in `variant`: fp32, bf16, or our int8 weight-only layers."""
    import copy

    import torch

    from mindspeed_llm.generation.quantize import quantize_weights

    if variant == "fp32":
        return ours, theirs
    if variant == "bf16":
        return copy.deepcopy(ours).to(torch.bfloat16), copy.deepcopy(theirs).to(torch.bfloat16)
    if variant == "int8":
        return quantize_weights(copy.deepcopy(ours)), theirs
    raise SystemExit(f"--variants: unknown variant {variant!r} (fp32, bf16, int8)")


def weight_bytes_per_token(model) -> int:
    """Bytes a decode step reads: every parameter and buffer but the embedding table, of
    which one row per token is read."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    embedding = model.tok_embeddings.weight
    read = sum(t.numel() * t.element_size() for t in tensors.values() if t is not embedding)
    return read + embedding.shape[1] * embedding.element_size()


def read_bandwidth(device, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a reduction streams through memory (the median of `repeats`)."""
    import torch

    from mindspeed_core import device as dev

    x = torch.ones(int(gib * 2**30) // 4, device=device)
    times = []
    for _ in range(repeats + 1):
        dev.synchronize(device)
        start = time.perf_counter()
        x.sum().item()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times[1:])


def _timed(fn, device, repeats):
    from mindspeed_core import device as dev

    out = fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        dev.synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        dev.synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), out


def _sides(ours, theirs, prompts, new_tokens):
    import torch

    from mindspeed_llm.generation import GenerationConfig, generate

    def mine(n):
        return lambda: generate(ours, prompts.tolist(), GenerationConfig(max_new_tokens=n))

    def hf(n):
        def run():
            with torch.inference_mode():
                out = theirs.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            return out[:, prompts.shape[1] :].tolist()

        return run

    return {"ours": (mine(new_tokens), mine(1)), "transformers": (hf(new_tokens), hf(1))}


def run_batch(ours, theirs, batch, new_tokens, repeats, device) -> dict:
    import torch

    gen = torch.Generator().manual_seed(batch)
    vocab = ours.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen).to(device)
    result = {"bench": "generate_decode", "batch": batch, "new_tokens": new_tokens}
    tokens = {}
    for side, (full, first) in _sides(ours, theirs, prompts, new_tokens).items():
        wall, cpu, tokens[side] = _timed(full, device, repeats)
        prefill_wall, prefill_cpu, _ = _timed(first, device, repeats)
        decoded = batch * (new_tokens - 1)
        result[side] = {
            "decode_tokens_per_s": round(decoded / (wall - prefill_wall), 1),
            "decode_tokens_per_cpu_s": round(decoded / (cpu - prefill_cpu), 1),
            "total_s": round(wall, 3),
            "prefill_s": round(prefill_wall, 4),
        }
    result["same_tokens"] = tokens["ours"] == tokens["transformers"]
    result["tokens"] = tokens["ours"]
    for key, metric in (
        ("speedup", "decode_tokens_per_s"),
        ("cpu_speedup", "decode_tokens_per_cpu_s"),
    ):
        result[key] = round(result["ours"][metric] / result["transformers"][metric], 3)
    return result


def main() -> None:
    import os

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="headline,small")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--variants", default="fp32,bf16,int8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bandwidth = read_bandwidth(device)
    for name in args.configs.split(","):
        hf_config = CONFIGS[name]
        base = _models(device, hf_config)
        shape = f"llama {hf_config['num_hidden_layers']}x{hf_config['hidden_size']}"
        fp32_tokens = {}
        for variant in args.variants.split(","):
            ours, theirs = _variant(*base, variant)
            per_token = weight_bytes_per_token(ours)
            for batch in (int(b) for b in args.batches.split(",")):
                result = run_batch(ours, theirs, batch, args.new_tokens, args.repeats, device)
                tokens = result.pop("tokens")
                if variant == "fp32":
                    fp32_tokens[batch] = tokens
                elif batch in fp32_tokens:
                    result["agreement_with_fp32"] = _agreement(tokens, fp32_tokens[batch])
                limit = bandwidth / per_token * batch  # tokens/s if only weights were read
                result.update(
                    variant=variant,
                    theirs="transformers " + ("bf16" if variant == "bf16" else "fp32"),
                    weight_mb_per_step=round(per_token / 2**20, 2),
                    read_gb_per_s=round(bandwidth / 1e9, 2),
                    weight_streaming_limit_tokens_per_s=round(limit, 1),
                    fraction_of_limit=round(result["ours"]["decode_tokens_per_s"] / limit, 3),
                    config=f"{name}: {shape}, vocab {hf_config['vocab_size']}, prompt 32",
                    device=args.device,
                    threads=torch.get_num_threads(),
                    load_avg_1min=round(os.getloadavg()[0], 2),
                )
                print(json.dumps(result), flush=True)


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of greedy tokens equal to the reference's, each row up to its first
    difference (after one, the rows decode different contexts)."""
    same = total = 0
    for row, ref in zip(tokens, reference, strict=True):
        total += len(ref)
        for a, b in zip(row, ref, strict=False):
            if a != b:
                break
            same += 1
    return round(same / max(total, 1), 3)

if __name__ == "__main__":
    main()
