"""The HTTP side of `mindspeed serve`: OpenAI-compatible request parsing, checks and
responses (whole or streamed as server-sent events) over an `Engine`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import secrets
import time
from collections.abc import AsyncIterator

import torch

from mindspeed_core.errors import MindSpeedError
from mindspeed_llm.generation import GenerationConfig, TextStream
from mindspeed_tools.chat import END_OF_TURN
from mindspeed_tools.serve.engine import Engine, Job, QueueFull, Sample

MAX_N = 16
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")
"""The chat roles a request may use (OpenAI's; the template decides what it renders)."""
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds a torch generator takes."""


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
        self.draining = asyncio.Event()  # set when shutdown begins: bodies still arriving get 503
        self.preparing = 0  # requests whose body is read, not yet submitted (rendering)

    async def drain(self, poll_s: float = 0.05) -> None:
        """Refuse the bodies still arriving and wait until no request is left: those being
        prepared are submitted, the streams in flight and the requests queued behind them
        finish."""
        self.draining.set()
        while self.preparing or any(self.engine.load().values()):
            await asyncio.sleep(poll_s)

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
        from starlette.requests import ClientDisconnect

        try:
            body = await self._body(request)
            self.preparing += 1
            try:
                job, stream, include_usage = await self._prepare(body, chat)
            finally:
                self.preparing -= 1
        except BadRequest as err:
            return err.response()
        except ClientDisconnect:  # the client left mid-body: no one to answer
            return BadRequest("the client disconnected before its body was complete").response()
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}", "created": int(time.time()),
                "model": self.model_name}  # fmt: skip
        if stream:
            from starlette.responses import StreamingResponse

            events = self._stream(job, meta, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(job, meta, chat)

    async def _prepare(self, body: dict, chat: bool) -> tuple[Job, bool, bool]:
        """The request's job, submitted to the engine, and its stream options."""
        stream, include_usage = _stream_options(body)
        prompt = await self._chat_prompt(body) if chat else self._text_prompt(body)
        job = self._job(body, prompt, chat)
        try:
            self.engine.submit(job)
        except QueueFull:
            raise BadRequest(
                f"the server is busy: {self.engine.max_queue} requests are already waiting",
                status=429, kind="rate_limit_error",
            ) from None  # fmt: skip
        return job, stream, include_usage

    async def _body(self, request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise BadRequest(f"request body of {declared} bytes exceeds {self.max_body}", status=413)
        raw = b""
        chunks = aiter(request.stream())
        while (chunk := await self._unless_draining(anext(chunks, None))) is not None:
            raw += chunk
            if len(raw) > self.max_body:
                raise BadRequest(f"request body exceeds {self.max_body} bytes", status=413)
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise BadRequest(f"the body is not valid JSON: {err}") from None
        except RecursionError:  # Python's decoder recurses once per level
            raise BadRequest("the body is not valid JSON: it nests too deep") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here; /v1/models lists "
                             f"{self.model_name!r}", "model", status=404,
                             kind="not_found_error")  # fmt: skip
        return body

    async def _unless_draining(self, pending):
        """`await pending`, unless shutdown begins first: then 503 (a client that never
        finishes its body must not hold the server up)."""
        task = asyncio.ensure_future(pending)
        draining = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait((task, draining), return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if not task.done():
            task.cancel()
            raise BadRequest("the server is shutting down", status=503, kind="server_error")
        return task.result()

    async def _chat_prompt(self, body: dict) -> list[int]:
        clean = _chat_messages(body.get("messages"))

        def render() -> list[int]:  # off the event loop: a slow template stalls no one else
            text = self.template.render(clean, add_generation_prompt=True)
            return self.generator.encode(text, add_bos=False)

        try:
            return await asyncio.to_thread(render)
        except MindSpeedError as err:
            raise BadRequest(f"messages: the chat template refused them: {err}", "messages") from None

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
        seed = _int(body, "seed", None, *SEED_RANGE)
        top_logprobs = None
        if chat and not isinstance(body.get("logprobs", False), bool | None):
            raise BadRequest(f"logprobs must be true or false, got {body['logprobs']!r:.40}", "logprobs")
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


def _chat_messages(messages) -> list[dict]:
    """The request's messages, checked: each a known role with string (or text-part)
    content; only an assistant turn that calls tools may go without content."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        role = message["role"]
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role {role[:40]!r} is not one of {', '.join(ROLES)}",
                             "messages")  # fmt: skip
        content = message.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 "messages")  # fmt: skip
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise BadRequest(f"messages[{i}].content is missing ({role} turns need one)", "messages")
        if content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        clean.append({**message, "content": content or ""})
    return clean


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), each a JSON boolean or absent."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r:.40}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise BadRequest(f"stream_options.include_usage must be true or false, got {usage!r:.40}",
                         "stream_options")  # fmt: skip
    return bool(stream), bool(usage)


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


def _int(body: dict, name: str, default: int | None, low: int, high: int | None) -> int | None:
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

