"""The decode loop of `mindspeed serve`: jobs (a request's prompt, settings and event
queue), the engine thread that batches them continuously over a `DecodeBatch`, and the
tensor-parallel mirror of that batch on the other ranks."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from mindspeed_core.errors import MindSpeedError
from mindspeed_llm.generation import GenerationConfig, TextStream
from mindspeed_llm.generation.batching import DecodeBatch
from mindspeed_llm.generation.sampling import next_tokens

logger = logging.getLogger(__name__)

HEARTBEAT_S = 60.0  # an idle tp server still talks to its other ranks this often

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

