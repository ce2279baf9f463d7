"""`mindspeed serve`'s command line and its embedded demo."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError
from mindspeed_llm.generation import GenerationConfig
from mindspeed_llm.generation.batching import DecodeBatch
from mindspeed_tools.generate import add_model_arguments, closing_process_group, load_generator
from mindspeed_tools.serve.api import Server
from mindspeed_tools.serve.engine import Engine, LocalBatch, ReplicatedBatch, follow

logger = logging.getLogger("mindspeed_tools.serve")

def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="mindspeed serve",
                       description="Serve a local model over an OpenAI-compatible HTTP API.")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; 0.0.0.0 exposes the server)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the folder's)")
    p.add_argument("--max-batch", type=int, default=32, help="rows decoded together (default 32)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond the batch before 429 (default 64)")  # fmt: skip
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body (default 1 MiB)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=5.0,
                   help="on SIGTERM, the requests in flight finish; connections still open "
                   "after that are closed this many seconds later (default 5)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int,
                   help="a request's max_tokens when it names none (default: the model's "
                   "generation_config.json, else 256)")  # fmt: skip
    add_model_arguments(p, sampling=False)
    for action in p._actions:  # no --model: the embedded demo
        if action.dest == "model":
            action.required = False
    return p


def demo(stdout=None) -> dict:
    """Serve a small random Llama (the demo tokenizer) on a free loopback port, send it the
    same 16 greedy requests one at a time and then all at once, and print what it served."""
    import urllib.request

    import uvicorn

    from mindspeed_core.testing.spawn import free_port
    from mindspeed_llm.chat_template import load_chat_template
    from mindspeed_llm.demo import ensure_demo_data
    from mindspeed_llm.generation import Generator
    from mindspeed_llm.models import Transformer, TransformerConfig
    from mindspeed_llm.tokenizer import load_tokenizer

    stdout = stdout or __import__("sys").stdout
    tokenizer = load_tokenizer(ensure_demo_data().tokenizer)
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, hidden_size=256, intermediate_size=688,
                               num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=512)  # fmt: skip
    model = Transformer(config).eval()
    generator = Generator(model, tokenizer, GenerationConfig(max_new_tokens=24))
    engine = Engine(generator, LocalBatch(DecodeBatch(model)), max_batch=32, max_queue=64)
    server = Server(engine, generator, load_chat_template(tokenizer.path), "demo", 1 << 20)
    port = free_port()
    uv_server = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port,
                                              log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=uv_server.run, daemon=True)
    engine.start()
    thread.start()
    while not uv_server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    print(f"serving a random demo model ({config.num_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}) on {url}", file=stdout)  # fmt: skip

    def ask(i: int) -> tuple[str, float]:
        body = {"model": "demo", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": f"question {i}: how many apples?"}]}  # fmt: skip
        request = urllib.request.Request(url, json.dumps(body).encode(),
                                         {"content-type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.loads(response.read())
        return reply["choices"][0]["message"]["content"], time.perf_counter() - start

    results = {}
    try:
        ask(0)  # warm-up
        for clients in (1, 16):
            start = time.perf_counter()
            if clients == 1:
                answers = [ask(i) for i in range(16)]
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(clients) as pool:
                    answers = list(pool.map(ask, range(16)))
            wall = time.perf_counter() - start
            results[clients] = {"requests_per_s": 16 / wall,
                                "latency_s": sum(a[1] for a in answers) / 16,
                                "answers": [a[0] for a in answers]}  # fmt: skip
    finally:
        uv_server.should_exit = True
        thread.join()
        engine.stop()
    same = results[1]["answers"] == results[16]["answers"]
    print(f"{'clients':>8} {'requests/s':>11} {'mean latency':>13}", file=stdout)
    for clients, r in results.items():
        print(f"{clients:>8} {r['requests_per_s']:>11.2f} {r['latency_s']:>12.2f}s", file=stdout)
    speedup = results[16]["requests_per_s"] / results[1]["requests_per_s"]
    print(f"16 concurrent clients: {speedup:.1f}x the requests/s of one at a time (continuous "
          f"batching); every answer equals its one-at-a-time answer: {'yes' if same else 'NO'}",
          file=stdout)  # fmt: skip
    return {"speedup": speedup, "same_answers": same, **results}


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, bound before the model loads (a port in use is one
    line at once, not after minutes of loading).

    Raises:
        ConfigError: the address cannot be bound (in use, not this machine's, no permission).
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as err:
        why = err.strerror or str(err)
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {why}") from None
    sock.set_inheritable(True)
    return sock


def draining_server(config, server: Server, drain_s: float):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) stops accepting, refuses the
    bodies still arriving (503), lets the requests in flight finish, and only then gives
    the connections left `drain_s` seconds before closing them (uvicorn's graceful-shutdown
    timeout, which would otherwise also cut the streams in flight)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            for listener in self.servers:  # no new connections while the rest drains
                listener.close()
            await server.drain()
            self.config.timeout_graceful_shutdown = drain_s
            await super().shutdown(sockets)

    return DrainingServer(config)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    args = _parser().parse_args(argv)
    for name in ("max_batch", "max_queue", "max_request_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise ConfigError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("mindspeed serve needs Starlette and uvicorn: "
                          "pip install 'mindspeed-tools[serve]'") from None  # fmt: skip
    if args.model is None:
        return 0 if demo()["same_answers"] else 1
    from mindspeed_llm.chat_template import load_chat_template

    with closing_process_group():
        # rank 0 (torchrun's RANK: the process group starts with the model) listens
        sock = listen(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
        generator = load_generator(args)
        batch = DecodeBatch(generator.model)
        if args.tp > 1 and not _is_rank0():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when to stop
            follow(batch)
            return 0
        engine = Engine(generator, ReplicatedBatch(batch) if args.tp > 1 else LocalBatch(batch),
                        max_batch=args.max_batch, max_queue=args.max_queue)  # fmt: skip
        template = load_chat_template(generator.tokenizer.path)
        name = args.served_model_name or Path(args.model).resolve().name
        server = Server(engine, generator, template, name, args.max_request_bytes)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("serving on %s: reachable from other machines", args.host)
        engine.start()
        config = uvicorn.Config(server.app(), log_level="warning")
        uv_server = draining_server(config, server, args.drain_timeout)
        # uvicorn re-raises the signal that stopped it once it has shut down; after a
        # graceful SIGTERM shutdown this handler makes that a no-op, so the command exits 0
        signal.signal(signal.SIGTERM, lambda *_: None)
        port = sock.getsockname()[1]
        print(f"serving {name} on http://{args.host}:{port}/v1 (Ctrl-C or SIGTERM stops)",
              flush=True)  # fmt: skip
        try:
            uv_server.run(sockets=[sock])
        finally:
            sock.close()
            if engine.thread.is_alive():
                engine.stop()
    return 0


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the engine thread decodes too
command = Command(help="serve a local model over an OpenAI-compatible HTTP API", run=main)

