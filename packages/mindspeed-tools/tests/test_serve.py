"""`mindspeed serve` on 127.0.0.1, spoken to by OpenAI's own Python client: greedy chat
completions equal `mindspeed generate --chat` token for token; streamed chunks concatenate
to the whole text; 32 concurrent clients each get their single-client answer (continuous
batching, 8 rows at a time); seeded sampling repeats; malformed and hostile requests get a
4xx JSON error naming the field, log no traceback, and the next good request is answered;
a request past the queue gets 429; SIGTERM lets the requests in flight finish, refuses a
body still arriving, and exits 0; a port in use is one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_core.testing import import_sibling
from mindspeed_core.testing.spawn import free_port

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
chat_tests = import_sibling(__file__, "test_generate_chat")

PROMPTS = [f"w{10 + 7 * i} w{20 + 3 * i}" for i in range(32)]


def _http(url: str, body: bytes | None = None, timeout: float = 30) -> tuple[int, dict]:
    """(status, JSON body) of a GET (or a POST of `body`), with the standard library."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Served:
    """A `mindspeed serve` process on a free loopback port."""

    def __init__(self, model_dir: Path, *extra: str):
        self.port = free_port()
        code = "import sys; from mindspeed_core.cli import main; sys.exit(main())"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--model", str(model_dir), "--port",
             str(self.port), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read()[-3000:]
            try:
                if _http(f"{self.url}/v1/models", timeout=1)[0] == 200:
                    break
            except OSError:  # not listening yet
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def chat(self, text: str, **kwargs):
        return self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}], **kwargs
        )

    def close(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        _, err = self.process.communicate(timeout=60)
        assert "Traceback" not in err, err[-3000:]  # bad requests log no traceback
        return self.process.returncode

    def answers(self) -> bool:
        """A good request still gets its answer."""
        return bool(self.chat(PROMPTS[0], temperature=0, max_tokens=1).choices)

    def half_body(self, sent: bytes = b'{"messag') -> socket.socket:
        """A connection that declares a 500-byte body and sends only its first bytes."""
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 500\r\n\r\n" + sent)  # fmt: skip
        return conn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """generate/chat's tiny Llama: a word-level tokenizer, a chat template, eos 1, 10 tokens."""
    folder = tmp_path_factory.mktemp("served-llama")
    chat_tests.models_hf.make_hf("llama").save_pretrained(folder)
    chat_tests._save_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "max_new_tokens": 10}))
    return folder


@pytest.fixture(scope="module")
def served(model_dir):
    server = Served(model_dir, "--max-batch", "8", "--max-queue", "32", "--max-request-bytes", "65536")
    yield server
    assert server.close() == 0


def _generate_chat(model_dir, prompts, capsys):
    assert cli(["generate", "--model", str(model_dir), "--chat", *prompts]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_greedy_chat_equals_generate_token_for_token(served, model_dir, capsys):
    expected = _generate_chat(model_dir, PROMPTS[:3], capsys)
    from mindspeed_llm.tokenizer import load_tokenizer

    decode = load_tokenizer(model_dir).decode
    for prompt, record in zip(PROMPTS[:3], expected, strict=True):
        reply = served.chat(prompt, temperature=0, logprobs=True, top_logprobs=2)
        choice = reply.choices[0]
        ids = [t for t in record["token_ids"] if t != 1]  # the stop token is not text
        assert [e.token for e in choice.logprobs.content] == [decode([t]) for t in record["token_ids"]]
        assert choice.message.content == record["completion"] == decode(ids)
        assert choice.finish_reason == record["finish_reason"]
        assert reply.usage.completion_tokens == len(record["token_ids"])
        top = choice.logprobs.content[0].top_logprobs
        assert top[0].logprob >= top[1].logprob and top[0].token == choice.logprobs.content[0].token


def test_stream_concatenates_to_the_whole_text(served):
    whole = served.chat(PROMPTS[5], temperature=0, max_tokens=12)
    chunks = list(served.chat(PROMPTS[5], temperature=0, max_tokens=12, stream=True,
                              stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(chunks) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion = served.client.completions.create(model=served.model, prompt=PROMPTS[5],
                                                  temperature=0, max_tokens=4, stop=["w99"])  # fmt: skip
    assert completion.choices[0].text and completion.usage.prompt_tokens > 0


def test_32_concurrent_clients_get_their_single_client_answers(served):
    alone = [served.chat(p, temperature=0, max_tokens=16).choices[0].message.content for p in PROMPTS]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(
            lambda p: served.chat(p, temperature=0, max_tokens=16).choices[0].message.content, PROMPTS
        ))  # fmt: skip
    assert together == alone
    assert len(set(alone)) > 1  # different prompts, different answers
    # sampling: n samples, a seed repeats them, another seed changes them
    first = served.chat(PROMPTS[0], temperature=1.0, seed=7, n=3, max_tokens=8)
    again = served.chat(PROMPTS[0], temperature=1.0, seed=7, n=3, max_tokens=8)
    other = served.chat(PROMPTS[0], temperature=1.0, seed=8, n=3, max_tokens=8)
    texts = lambda r: [c.message.content for c in r.choices]  # noqa: E731
    assert texts(first) == texts(again) != texts(other) and len(set(texts(first))) > 1


def test_malformed_requests_get_a_json_error(served):
    url = f"{served.url}/v1/chat/completions"
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "w7"}], "temperature": 9}).encode(), 400, "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "w7"}], "max_tokens": 10**6}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "w7"}], "n": 0}).encode(), 400, "n"),
        (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "w7"}]}).encode(), 404, "model"),
        (b"{" + b" " * 100_000 + b"}", 413, None),  # over --max-request-bytes
    ]
    for body, status, param in cases:
        code, reply = _http(url, body)
        assert code == status, (body[:60], reply)
        error = reply["error"]
        assert error["message"] and error["param"] == param, error
    assert served.answers()


def test_hostile_requests_get_a_4xx_naming_the_field_and_the_next_is_answered(served):
    """Each gets its 4xx JSON error (no 500, no traceback in the server's log: the fixture
    checks at exit), and a good request is answered after each."""
    url = f"{served.url}/v1/chat/completions"
    user = [{"role": "user", "content": "w7"}]
    cases = [
        ({"messages": user, "seed": 1208925819614629174706176}, "seed", "seed must be an integer"),
        (b'{"messages":' + b"[" * 30_000 + b"1" + b"]" * 30_000 + b"}", None, "nests too deep"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0].content is missing"),
        ({"messages": [{"role": "wizard", "content": "w7"}]}, "messages", "'wizard' is not one of"),
        ({"messages": user, "stream": "yes"}, "stream", "stream must be true or false"),
        ({"messages": user, "stream": True, "stream_options": {"include_usage": "y"}},
         "stream_options", "include_usage must be true or false"),
        ({"messages": user, "logprobs": "yes"}, "logprobs", "logprobs must be true or false"),
    ]  # fmt: skip
    for body, param, message in cases:
        code, reply = _http(url, body if isinstance(body, bytes) else json.dumps(body).encode())
        assert code == 400 and reply["error"]["param"] == param, (param, reply)
        assert message in reply["error"]["message"], reply
        assert served.answers(), param
    # an assistant turn that calls a tool may go without content
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [*user, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c1", "content": "w3"}]  # fmt: skip
    assert _http(url, json.dumps({"messages": history, "max_tokens": 1}).encode())[0] == 200
    # a client that leaves mid-body: nothing to answer, nothing logged, the next one answered
    served.half_body().close()
    assert served.answers()
    with pytest.raises(openai.BadRequestError, match="temperature must be a number"):
        served.chat("w7", temperature=-1)


def test_queue_limit_and_sigterm_finish_what_is_in_flight(model_dir):
    """SIGTERM: the stream in flight and the request queued behind it finish; a body still
    arriving gets 503; an idle keep-alive connection cannot hold the server past
    --drain-timeout; exit 0."""
    server = Served(model_dir, "--max-batch", "1", "--max-queue", "1", "--drain-timeout", "1")
    try:
        running = server.chat(PROMPTS[1], temperature=0, max_tokens=200, stream=True)
        first = next(iter(running))  # decoding: it holds the one row
        queued: dict = {}
        waiter = threading.Thread(target=lambda: queued.update(
            reply=server.chat(PROMPTS[2], temperature=0, max_tokens=5)))  # fmt: skip
        waiter.start()
        deadline = time.monotonic() + 30
        while _http(f"{server.url}/health")[1]["waiting_requests"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="1 requests are already waiting"):
            server.chat(PROMPTS[3], temperature=0, max_tokens=5)
        stalled = server.half_body()  # a client that never finishes its body
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        idle.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # keep-alive, then quiet
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        server.process.send_signal(signal.SIGTERM)  # both requests are in flight
        rest = list(running)
        waiter.join(timeout=60)
        drained = time.monotonic()
        assert first.choices[0].delta.role == "assistant"
        assert rest[-1].choices[0].finish_reason in ("stop", "length")
        assert queued["reply"].choices[0].message.content
        assert stalled.recv(4096).startswith(b"HTTP/1.1 503")  # refused, not waited for
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - drained < 10  # the drain timeout (1 s) past the last request
        with pytest.raises(OSError):  # no longer listening
            _http(f"{server.url}/v1/models", timeout=2)
    finally:
        server.process.kill()


def test_a_port_in_use_is_one_line_before_the_model_loads(model_dir, capfd):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli(["serve", "--model", str(model_dir), "--port", str(port)]) == 2
    out, err = capfd.readouterr()
    assert "serving" not in out and err.count("\n") == 1, (out, err)
    assert f"--port {port}: cannot listen there: Address already in use" in err


def test_a_slow_template_renders_off_the_event_loop(model_dir, monkeypatch):
    """A conversation that makes the chat template run into its time limit is a 400 naming
    messages, and /health answers at once meanwhile (the render runs in a thread, where
    the limit holds too)."""
    import uvicorn

    from mindspeed_llm import chat_template
    from mindspeed_llm.generation import GenerationConfig, Generator
    from mindspeed_llm.generation.batching import DecodeBatch
    from mindspeed_llm.loading import load_model, resolve_model_source
    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_tools.serve.api import Server
    from mindspeed_tools.serve.engine import Engine, LocalBatch

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)
    slow = chat_template.ChatTemplate(
        "{% for m in messages %}{% if m.content == 'slow' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}"
        "{% endfor %}"
    )  # fmt: skip
    source = resolve_model_source(str(model_dir))
    model, _ = load_model(source)
    generator = Generator(model, load_tokenizer(source.tokenizer), GenerationConfig(max_new_tokens=2))
    engine = Engine(generator, LocalBatch(DecodeBatch(model)), max_batch=4, max_queue=4)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(Server(engine, generator, slow, "m", 1 << 16).app(),
                                       host="127.0.0.1", port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    engine.start()
    thread.start()
    try:
        while not uv.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"messages": [{"role": "user", "content": "slow"}]}).encode()
        with ThreadPoolExecutor(1) as pool:
            refused = pool.submit(_http, f"{url}/v1/chat/completions", body)
            time.sleep(0.3)
            waits = []
            while not refused.done():
                start = time.monotonic()
                assert _http(f"{url}/health")[0] == 200
                waits.append(time.monotonic() - start)
                time.sleep(0.1)
            code, reply = refused.result()
        assert code == 400 and reply["error"]["param"] == "messages", reply
        assert "ran for more than 2 s" in reply["error"]["message"], reply
        assert len(waits) > 5 and max(waits) < 1.0, waits
    finally:
        uv.should_exit = True
        thread.join()
        engine.stop()


@pytest.mark.slow
@pytest.mark.distributed
def test_serve_under_tp2_answers_as_one_process(served, model_dir):
    """`torchrun --nproc-per-node 2 ... serve --tp 2`: rank 0 serves, both ranks decode; the
    greedy answers (several requests batched together) equal the one-process server's."""
    port = free_port()
    code = "import sys; from mindspeed_core.cli import main; sys.exit(main())"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDSPEED_DEVICE": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--no-python", sys.executable, "-c", code, "serve", "--model", str(model_dir),
         "--port", str(port), "--tp", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            try:
                if _http(f"http://127.0.0.1:{port}/v1/models", timeout=1)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

        def ask(c, p):
            reply = c.chat.completions.create(model=served.model, temperature=0, max_tokens=12,
                                              messages=[{"role": "user", "content": p}])  # fmt: skip
            return reply.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            sharded = list(pool.map(lambda p: ask(client, p), PROMPTS[:4]))
        assert sharded == [ask(served.client, p) for p in PROMPTS[:4]]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
def test_embedded_demo_serves_and_every_answer_is_the_same(capsys):
    """`mindspeed serve` with no arguments: a random model served on loopback, 16 requests
    one at a time and all at once; the same answers, and a table printed."""
    assert cli(["serve"]) == 0
    out = capsys.readouterr().out
    assert "every answer equals its one-at-a-time answer: yes" in out
    assert out.count("requests/s") == 2 and "serving a random demo model" in out
