"""`mindspeed serve`: an OpenAI-compatible HTTP server for a local model.

    mindspeed serve --model DIR [--host 127.0.0.1] [--port 8000]
    torchrun --nproc-per-node 2 -m mindspeed_core.cli serve --model DIR --tp 2
    mindspeed serve      # the embedded demo: serves a small random model on a free loopback
                         # port, talks to it with 1 and 16 concurrent clients, prints a table

Endpoints: `POST /v1/chat/completions` (the model's chat template), `POST /v1/completions`,
`GET /v1/models`, `GET /health` (rows running, requests waiting). Supported request fields:
`messages` / `prompt`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`,
`n`, `stop`, `seed`, `stream` (server-sent events, `stream_options.include_usage`),
`logprobs` and `top_logprobs` (log-probabilities of the model's own distribution, before
temperature and top-p). Others are accepted and ignored, as OpenAI-compatible servers do.

Requests are batched continuously (`mindspeed_llm.generation.batching.DecodeBatch`): a new
request joins the running decode batch at the next step, a finished row leaves it. At most
`--max-batch` rows decode together; up to `--max-queue` requests wait beyond them, and the
next one gets HTTP 429. A body over `--max-request-bytes` gets 413, a malformed one 400 with
an OpenAI-style JSON error naming the field. SIGTERM stops accepting, lets the requests in
flight finish, and exits 0. The server listens on loopback unless `--host` says otherwise.

Needs `pip install 'mindspeed-tools[serve]'` (Starlette and uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError, MindSpeedError
from mindspeed_llm.generation import GenerationConfig, TextStream
from mindspeed_llm.generation.batching import DecodeBatch
from mindspeed_llm.generation.sampling import next_tokens
from mindspeed_tools.chat import END_OF_TURN
from mindspeed_tools.generate import add_model_arguments, closing_process_group, load_generator

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
HEARTBEAT_S = 60.0  # an idle tp server still talks to its other ranks this often


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def response(self):
        from starlette.responses import JSONResponse

        body = {"message": str(self), "type": self.kind, "param": self.param, "code": None}
        return JSONResponse({"error": body}, status_code=self.status)


# -- requests -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One of a request's n outputs."""

    stream: TextStream
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Job:
    """A request admitted by the engine: its prompt, settings and where its events go."""

    id: str
    prompt: list[int]
    n: int
    max_tokens: int
    config: GenerationConfig
    top_logprobs: int | None  # None: no logprobs
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    samples: list[Sample] = field(default_factory=list)
    generator: torch.Generator | None = None
    cancelled: bool = False

    def emit(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class QueueFull(Exception):
    pass


class Engine:
    """The decode loop, in a thread of its own: admits waiting jobs into the `DecodeBatch`
    between steps, draws every row's token, and sends each job its events:
    ("token", sample, text, logprob entry or None), ("done", sample, finish_reason),
    ("error", message)."""

    def __init__(self, generator, batch, *, max_batch: int, max_queue: int):
        self.generator, self.batch = generator, batch
        self.tokenizer = generator.tokenizer
        # A vocabulary padded beyond the tokenizer's (for tp, or a multiple of 64) holds ids
        # no text stands for: they are never drawn.
        self.vocab = generator.tokenizer.vocab_size
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: deque[Job] = deque()
        self.jobs: dict[str, Job] = {}
        self.last: dict[tuple[str, int], int] = {}  # row -> its last drawn token
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="mindspeed-serve", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
            self.waiting.append(job)
            self.cond.notify()

    def load(self) -> dict[str, int]:
        with self.cond:
            return {"running_rows": len(self.batch), "waiting_requests": len(self.waiting)}

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if not self.cond.wait_for(
                        lambda: self.stopping or self.waiting or len(self.batch), HEARTBEAT_S
                    ):
                        self.batch.noop()
                        continue
                    if self.stopping:
                        break
                    admitted = self._admit()
                for job in admitted:
                    self._join(job)
                self._drop_finished()
                if len(self.batch):
                    logits = self.batch.step(self.last)
                    for row, row_logits in zip(list(self.batch.ids), logits, strict=True):
                        self._draw(row, row_logits)
                    self._drop_finished()
        except Exception as err:  # noqa: BLE001  (every job must hear of it; the server says so)
            logger.exception("the decode loop failed")
            for job in list(self.jobs.values()) + list(self.waiting):
                job.emit(("error", f"generation failed: {err}"))
        finally:
            self.batch.close()

    def _admit(self) -> list[Job]:
        admitted, rows = [], len(self.batch)
        while self.waiting and rows + self.waiting[0].n <= self.max_batch:
            job = self.waiting.popleft()
            if not job.cancelled:
                admitted.append(job)
                rows += job.n
        return admitted

    def _join(self, job: Job) -> None:
        self.jobs[job.id] = job
        rows = [(job.id, k) for k in range(job.n)]
        try:
            logits = self.batch.join(rows, [job.prompt] * job.n, [job.max_tokens] * job.n)
        except MindSpeedError as err:
            del self.jobs[job.id]
            job.emit(("error", str(err)))
            return
        for row, row_logits in zip(rows, logits, strict=True):
            self._draw(row, row_logits)

    def _draw(self, row: tuple[str, int], logits: torch.Tensor) -> None:
        job = self.jobs[row[0]]
        sample = job.samples[row[1]]
        if sample.finish_reason is not None or job.cancelled:
            return
        try:
            self._draw_token(job, row, sample, logits[: self.vocab])
        except Exception as err:  # noqa: BLE001  (this request fails; the others go on)
            logger.exception("request %s failed", job.id)
            job.cancelled = True
            job.emit(("error", f"generation failed: {err}"))

    def _draw_token(self, job: Job, row: tuple[str, int], sample: Sample, logits: torch.Tensor) -> None:
        token = int(next_tokens(logits[None], job.config, None, job.generator)[0])
        entry = self._logprob_entry(logits, token, job.top_logprobs)
        self.last[row] = token
        sample.tokens.append(token)
        if token in job.config.stop_token_ids:
            text, reason = sample.stream.flush(), "stop"
        else:
            text = sample.stream.push(token)
            reason = "stop" if sample.stream.stopped else None
            if reason is None and len(sample.tokens) >= job.max_tokens:
                text, reason = text + sample.stream.flush(), "length"
        job.emit(("token", row[1], text, entry))
        if reason is not None:
            sample.finish_reason = reason
            job.emit(("done", row[1], reason))

    def _logprob_entry(self, logits: torch.Tensor, token: int, top: int | None) -> dict | None:
        if top is None:
            return None
        logp = torch.log_softmax(logits.float(), dim=-1)
        entry = self._token_entry(token, float(logp[token]))
        if top:
            values, ids = torch.topk(logp, top)
            entry["top_logprobs"] = [self._token_entry(int(i), float(v))
                                     for v, i in zip(values, ids, strict=True)]  # fmt: skip
        else:
            entry["top_logprobs"] = []
        return entry

    def _token_entry(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _drop_finished(self) -> None:
        gone = []
        for row in self.batch.ids:
            job = self.jobs[row[0]]
            if job.cancelled or job.samples[row[1]].finish_reason is not None:
                gone.append(row)
        if gone:
            self.batch.leave(gone)
            for row in gone:
                self.last.pop(row, None)
        live = {row[0] for row in self.batch.ids}
        for job_id in [j for j in self.jobs if j not in live]:
            del self.jobs[job_id]


class ReplicatedBatch:
    """A `DecodeBatch` whose every call rank 0 first sends to the other tensor-parallel
    ranks (`follow` runs it there), so all ranks run the same forwards."""

    def __init__(self, batch: DecodeBatch):
        self.batch = batch

    @property
    def ids(self):
        return self.batch.ids

    def __len__(self) -> int:
        return len(self.batch)

    def join(self, ids, prompts, budgets):
        _broadcast(("join", ids, prompts, budgets))
        return self.batch.join(ids, prompts, budgets)

    def step(self, tokens):
        _broadcast(("step", dict(tokens)))
        return self.batch.step(tokens)

    def leave(self, ids):
        _broadcast(("leave", ids))
        self.batch.leave(ids)

    def noop(self) -> None:
        _broadcast(("noop",))

    def close(self) -> None:
        _broadcast(("stop",))


class LocalBatch(ReplicatedBatch):
    """The one-process `DecodeBatch` (nothing to send)."""

    def join(self, ids, prompts, budgets):
        return self.batch.join(ids, prompts, budgets)

    def step(self, tokens):
        return self.batch.step(tokens)

    def leave(self, ids):
        self.batch.leave(ids)

    def noop(self) -> None:
        pass

    def close(self) -> None:
        pass


def _broadcast(command: tuple | None) -> tuple:
    import torch.distributed as dist

    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(batch: DecodeBatch) -> None:
    """Ranks other than 0 under --tp: run rank 0's batch calls until it stops."""
    while True:
        command = _broadcast(None)
        name, args = command[0], command[1:]
        if name == "stop":
            return
        if name != "noop":
            getattr(batch, name)(*args)


# -- the HTTP side --------------------------------------------------------------------------


class Server:
    """Request parsing and responses over an `Engine`."""

    def __init__(self, engine: Engine, generator, template, model_name: str, max_body: int):
        self.engine, self.generator, self.template = engine, generator, template
        self.model_name, self.max_body = model_name, max_body
        self.created = int(time.time())
        self.context = generator.model.config.max_position_embeddings
        base = generator.resolved_config()
        specials = generator.tokenizer.special_tokens
        self.stops = tuple(base.stop_token_ids)
        self.chat_stops = tuple(dict.fromkeys(
            self.stops + tuple(specials[p] for p in END_OF_TURN if p in specials)
        ))  # fmt: skip
        self.default_max_tokens = base.max_new_tokens
        self.counter = itertools.count()

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await asyncio.to_thread(self.engine.stop)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            lifespan=lifespan,
        )

    async def models(self, request):
        from starlette.responses import JSONResponse

        model = {"id": self.model_name, "object": "model", "created": self.created,
                 "owned_by": "mindspeed"}  # fmt: skip
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", **self.engine.load()})

    async def chat(self, request):
        return await self._handle(request, chat=True)

    async def completions(self, request):
        return await self._handle(request, chat=False)

    async def _handle(self, request, *, chat: bool):
        try:
            body = await self._body(request)
            prompt = self._chat_prompt(body) if chat else self._text_prompt(body)
            job = self._job(body, prompt, chat)
            try:
                self.engine.submit(job)
            except QueueFull:
                raise BadRequest(
                    f"the server is busy: {self.engine.max_queue} requests are already waiting",
                    status=429, kind="rate_limit_error",
                ) from None  # fmt: skip
        except BadRequest as err:
            return err.response()
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}", "created": int(time.time()),
                "model": self.model_name}  # fmt: skip
        if body.get("stream"):
            from starlette.responses import StreamingResponse

            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = self._stream(job, meta, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(job, meta, chat)

    async def _body(self, request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise BadRequest(f"request body of {declared} bytes exceeds {self.max_body}", status=413)
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise BadRequest(f"request body exceeds {self.max_body} bytes", status=413)
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise BadRequest(f"the body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here; /v1/models lists "
                             f"{self.model_name!r}", "model", status=404,
                             kind="not_found_error")  # fmt: skip
        return body

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        clean = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
            content = message.get("content")
            if isinstance(content, list):  # text parts
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                     "messages")  # fmt: skip
                content = "".join(str(p.get("text", "")) for p in content)
            if content is not None and not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
            clean.append({**message, "content": content or ""})
        try:
            text = self.template.render(clean, add_generation_prompt=True)
        except MindSpeedError as err:
            raise BadRequest(f"messages: the chat template refused them: {err}", "messages") from None
        return self.generator.encode(text, add_bos=False)

    def _text_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.generator.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.generator.model.config.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise BadRequest(f"prompt holds a token id outside 0..{vocab - 1}", "prompt")
            return list(prompt)
        raise BadRequest("prompt must be one non-empty string (or one list of token ids)",
                         "prompt")  # fmt: skip

    def _job(self, body: dict, prompt: list[int], chat: bool) -> Job:
        n = _int(body, "n", 1, 1, MAX_N)
        room = self.context - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt's {len(prompt)} tokens fill the model's context of "
                             f"{self.context}", "messages" if chat else "prompt")  # fmt: skip
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, key, min(self.default_max_tokens, room), 1, None)
        if max_tokens > room:
            raise BadRequest(f"{key}={max_tokens}: the prompt's {len(prompt)} tokens leave "
                             f"{room} of the model's context of {self.context}", key)  # fmt: skip
        temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise BadRequest("top_p must be in (0, 1]", "top_p")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS}",
                             "stop")  # fmt: skip
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer", "seed")
        top_logprobs = None
        if chat and body.get("logprobs"):
            top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        elif not chat and body.get("logprobs") is not None:
            top_logprobs = _int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS - 15)
        config = GenerationConfig(
            max_new_tokens=max_tokens, temperature=temperature, top_k=0, top_p=top_p or 1.0,
            stop_token_ids=self.chat_stops if chat else self.stops, stop_strings=tuple(stop),
        )  # fmt: skip
        generator = None
        if not config.greedy:
            generator = torch.Generator(device=self.engine.batch.batch.device)
            generator.manual_seed(seed if seed is not None else secrets.randbits(62))
        decode = self.generator.tokenizer.decode
        loop = asyncio.get_running_loop()
        return Job(
            id=f"{next(self.counter)}-{secrets.token_hex(4)}", prompt=prompt, n=n,
            max_tokens=max_tokens, config=config, top_logprobs=top_logprobs, loop=loop,
            events=asyncio.Queue(), generator=generator,
            samples=[Sample(TextStream(decode, config.stop_strings)) for _ in range(n)],
        )  # fmt: skip

    async def _events(self, job: Job) -> AsyncIterator[tuple]:
        """The job's events until every sample is done; a dropped client cancels the job."""
        done = 0
        try:
            while done < job.n:
                event = await job.events.get()
                if event[0] == "error":
                    raise BadRequest(event[1], status=500, kind="server_error")
                done += event[0] == "done"
                yield event
        finally:
            job.cancelled = done < job.n

    async def _whole(self, job: Job, meta: dict, chat: bool):
        from starlette.responses import JSONResponse

        texts = [""] * job.n
        try:
            async for event in self._events(job):
                if event[0] == "token":
                    texts[event[1]] += event[2]
                    if event[3] is not None:
                        job.samples[event[1]].logprobs.append(event[3])
        except BadRequest as err:
            return err.response()
        choices = []
        for i, (text, sample) in enumerate(zip(texts, job.samples, strict=True)):
            logprobs = _logprobs(sample.logprobs, chat) if job.top_logprobs is not None else None
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            choices.append({"index": i, **body, "logprobs": logprobs,
                            "finish_reason": sample.finish_reason})  # fmt: skip
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**meta, "object": kind, "choices": choices, "usage": _usage(job)})

    async def _stream(self, job: Job, meta: dict, chat: bool, include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra) -> str:
            return f"data: {json.dumps({**meta, 'object': kind, 'choices': choices, **extra})}\n\n"

        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(job.n)])  # fmt: skip
        try:
            async for event in self._events(job):
                if event[0] == "token":
                    _, i, text, entry = event
                    if not text and entry is None:
                        continue
                    logprobs = _logprobs([entry], chat) if entry is not None else None
                    body = {"delta": {"content": text}} if chat else {"text": text}
                    yield chunk([{"index": i, **body, "logprobs": logprobs, "finish_reason": None}])
                else:
                    _, i, reason = event
                    body = {"delta": {}} if chat else {"text": ""}
                    yield chunk([{"index": i, **body, "logprobs": None, "finish_reason": reason}])
        except BadRequest as err:
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': err.kind}})}\n\n"
            return
        if include_usage:
            yield chunk([], usage=_usage(job))
        yield "data: [DONE]\n\n"


def _usage(job: Job) -> dict:
    completion = sum(len(s.tokens) for s in job.samples)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
            "total_tokens": len(job.prompt) + completion}  # fmt: skip


def _logprobs(entries: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": entries}
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _int(body: dict, name: str, default: int, low: int, high: int | None) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
        high is not None and value > high
    ):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise BadRequest(f"{name} must be an integer {bounds}, got {value!r}", name)
    return value


def _float(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and low <= value <= high
    ):
        raise BadRequest(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


# -- the command ----------------------------------------------------------------------------


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
    add_model_arguments(p)
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
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("mindspeed serve needs Starlette and uvicorn: "
                          "pip install 'mindspeed-tools[serve]'") from None  # fmt: skip
    if args.model is None:
        return 0 if demo()["same_answers"] else 1
    from mindspeed_llm.chat_template import load_chat_template

    with closing_process_group():
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
        config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=None)  # fmt: skip
        uv_server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it has shut down; after a
        # graceful SIGTERM shutdown this handler makes that a no-op, so the command exits 0
        signal.signal(signal.SIGTERM, lambda *_: None)
        print(f"serving {name} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)",
              flush=True)  # fmt: skip
        try:
            uv_server.run()
        finally:
            if engine.thread.is_alive():
                engine.stop()
        if not uv_server.started:
            raise ConfigError(f"could not listen on {args.host}:{args.port} (in use?)")
    return 0


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the engine thread decodes too
command = Command(help="serve a local model over an OpenAI-compatible HTTP API", run=main)
