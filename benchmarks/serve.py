"""`mindspeed serve` against transformers' `generate` looped by a plain server, same model.

    python benchmarks/serve.py [--config headline|small] [--clients 1,8,32] [--new 32]
                               [--requests-per-client 2]

One random Llama (the generate benchmark's configs) is saved as a Hugging Face folder with
the demo tokenizer. Each side runs as its own server process on 127.0.0.1 and gets the same
load: C client threads, each sending `--requests-per-client` completion requests one after
another (a 32-token prompt each, greedy, exactly `--new` new tokens). Ours is `mindspeed
serve` (continuous batching, up to 32 rows). The baseline is the plain way to put a model
behind HTTP: a Starlette endpoint that runs `model.generate(do_sample=False)` for one request
at a time (a lock; requests wait in line). Time to first token is measured by streaming from
ours; the baseline cannot stream, so its first token comes with its whole answer.

Prints one JSON line per client count: requests/s, new tokens/s, mean time to first token,
and `ratio` = our requests/s over the baseline's; the last line says whether throughput at
32 clients reaches the goal (3x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from generate import CONFIGS, PROMPT_LEN  # noqa: E402  (the same models)

GOAL = 3.0


def _save_model(folder: Path, config_name: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.demo import ensure_demo_data

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIGS[config_name])).save_pretrained(folder)
    shutil.copy(ensure_demo_data().tokenizer, folder / "tokenizer.model")
    # no stop token in the way: every request makes exactly --new tokens on both sides
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))


def baseline_server(folder: str, port: int) -> None:
    """transformers' generate behind one plain HTTP endpoint, one request at a time."""
    import asyncio

    import torch
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    lock = threading.Lock()

    def run(ids, new):
        with lock, torch.inference_mode():
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)  # fmt: skip
            return out[0, len(ids) :].tolist()

    async def completions(request):
        body = await request.json()
        tokens = await asyncio.to_thread(run, body["prompt"], body["max_tokens"])
        return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": tokens,
                                          "finish_reason": "length"}],
                             "usage": {"completion_tokens": len(tokens)}})  # fmt: skip

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "baseline"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models)])  # fmt: skip
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _start(argv: list[str], port: int) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server did not start: {process.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
            return process
        except OSError:
            time.sleep(0.3)
    raise SystemExit("the server did not start in 300 s")


def _request(port: int, prompt: list[int], new: int, stream: bool) -> tuple[float, float, int]:
    """(time to first token, total time, new tokens) of one completion request."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        if not stream:
            reply = json.loads(response.read())
            tokens = reply["usage"]["completion_tokens"]
            first = time.perf_counter()
        else:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif "error" in chunk:
                    raise ValueError(chunk["error"]["message"])
                elif chunk["choices"][0]["text"]:
                    first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def _load(port: int, clients: int, per_client: int, new: int, stream: bool, prompts) -> dict:
    results, errors = [], []

    def client(index: int) -> None:
        try:
            for k in range(per_client):
                results.append(_request(port, prompts[(index * per_client + k) % len(prompts)], new, stream))
        except (OSError, ValueError, KeyError) as err:
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"requests failed: {errors[0]}")
    return {
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s": round(sum(r[2] for r in results) / wall, 1),
        "ttft_ms": round(1000 * statistics.mean(r[0] for r in results), 1),
        "new_tokens": sorted({r[2] for r in results}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="headline")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--new", type=int, default=32, help="new tokens per request")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--baseline-server", nargs=2, metavar=("FOLDER", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline_server:
        baseline_server(args.baseline_server[0], int(args.baseline_server[1]))
        return
    from mindspeed_core.testing.spawn import free_port
    from mindspeed_llm.tokenizer import load_tokenizer

    clients = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        _save_model(folder, args.config)
        vocab = load_tokenizer(folder).vocab_size
        prompts = [[(7 + 13 * i + 31 * j) % (vocab - 3) + 3 for j in range(PROMPT_LEN)] for i in range(64)]
        sides = {}
        for side in ("ours", "baseline"):
            port = free_port()
            if side == "ours":
                argv = [sys.executable, "-c", "import sys; from mindspeed_core.cli import main; "
                        "sys.exit(main())", "serve", "--model", str(folder), "--port", str(port),
                        "--max-batch", "32", "--max-queue", "256"]  # fmt: skip
            else:
                argv = [sys.executable, __file__, "--baseline-server", str(folder), str(port)]
            server = _start(argv, port)
            try:
                _load(port, 1, 1, args.new, side == "ours", prompts)  # warm-up
                sides[side] = {c: _load(port, c, args.requests_per_client, args.new,
                                        side == "ours", prompts) for c in clients}  # fmt: skip
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=120)
    for c in clients:
        ours, base = sides["ours"][c], sides["baseline"][c]
        print(json.dumps({"benchmark": "serve", "config": args.config, "clients": c,
                          "new_tokens": args.new, "ours": ours, "baseline": base,
                          "ratio": round(ours["requests_per_s"] / base["requests_per_s"], 2),
                          "cpu": os.cpu_count()}))  # fmt: skip
    top = max(clients)
    ratio = sides["ours"][top]["requests_per_s"] / sides["baseline"][top]["requests_per_s"]
    print(json.dumps({"benchmark": "serve", "goal": f">= {GOAL}x the looped baseline at {top} clients",
                      "ratio": round(ratio, 2), "met": ratio >= GOAL}))  # fmt: skip


if __name__ == "__main__":
    main()
