"""The LLM-judge reward against a scripted OpenAI-compatible stub on 127.0.0.1: the exact
request body, scores parsed and normalised by hand, a retry after a 500, a timeout and an
unparsable reply counted and scored 0, requests in flight together; and bad entries in a
YAML config or on the command line are one line, exit 2."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mindspeed_align.rl.config import GRPOConfig
from mindspeed_align.rl.data import demo_records
from mindspeed_align.rl.judge import DEFAULT_SCORE_REGEX
from mindspeed_align.rl.rewards import Rewards, reward_entries
from mindspeed_core.cli import run as cli
from mindspeed_core.config import config_from_args
from mindspeed_core.errors import DataError
from mindspeed_core.training import read_metrics
from mindspeed_llm.demo import ensure_demo_data

TEMPLATE = "Q: {prompt} | A: {completion} | ref: {reference} | {braces} stay"


class Stub:
    """A chat-completions endpoint whose reply to a user message is scripted: `script[key]`
    is a list of actions, one per attempt (the last repeats), where key is the text after
    "A: " up to " |" in the message (`script["*"]` for any other). Actions: a str (the reply's content), an int (that
    HTTP status), ("sleep", s, content), "garbage" (a body that is not a chat completion)."""

    def __init__(self, script: dict):
        self.script, self.bodies, self.headers = script, [], []
        self.attempts: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                key = body["messages"][-1]["content"].split("A: ")[1].split(" |")[0]
                with stub.lock:
                    stub.bodies.append((self.path, body))
                    stub.headers.append({k.lower(): v for k, v in self.headers.items()})
                    attempt = stub.attempts[key] = stub.attempts.get(key, 0) + 1
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    actions = stub.script.get(key, stub.script.get("*"))
                    self.act(actions[min(attempt, len(actions)) - 1])
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

            def act(self, action):
                if isinstance(action, tuple):
                    time.sleep(action[1])
                    action = action[2]
                if isinstance(action, int):
                    return self.send(action, {"error": {"message": "scripted"}})
                if action == "garbage":
                    return self.send(200, {"not": "a chat completion"})
                self.send(
                    200,
                    {
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": action}}
                        ]
                    },
                )

            def send(self, status, payload):
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client gave up (timeout)
                    self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    servers = []

    def start(script):
        servers.append(Stub(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _judge(url, **extra):
    return {"judge": url, "model": "grader-7b", "template": TEMPLATE, **extra}


def test_scores_are_parsed_normalised_and_weighted_and_the_body_is_exact(stub, monkeypatch):
    server = stub({
        "seven": ["Looks right.\nScore: 7"],
        "last": ["Score: 2 at first, but on reflection\n**Score:** 10"],
        "none": ["I cannot grade this."],
        "high": ["Score: 12"],
        "broken": ["garbage"],
    })  # fmt: skip
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    entry = _judge(server.url + "/", system="You grade.", api_key_env="JUDGE_KEY", weight=2.0,
                   max_tokens=64)  # fmt: skip
    rewards = Rewards(["exact_match", entry], workers=0)
    completions = ["seven", "last", "none", "high", "broken"]
    try:
        total, metrics = rewards([f"p{i}" for i in range(5)], completions,
                                 {"answer": ["seven", "x", "y", "z", "w"]})  # fmt: skip
    finally:
        rewards.close()
    # by hand: (7 - 0) / (10 - 0), the last "Score:" (10) -> 1.0; no score, 12 outside
    # [0, 10] and a body that is no chat completion -> 0 and counted
    judged = [0.7, 1.0, 0.0, 0.0, 0.0]
    assert total == pytest.approx([1.0 + 2 * judged[0], *(2 * j for j in judged[1:])])
    assert metrics["reward/judge"] == pytest.approx(sum(judged) / 5)
    assert metrics["reward/failures"] == 3
    assert metrics["reward/failures/judge/unparsed"] == 2
    assert metrics["reward/failures/judge/http_error"] == 1
    assert metrics["reward/failures/judge/timeout"] == 0
    [(path, body)] = [b for b in server.bodies if "A: last" in b[1]["messages"][1]["content"]]
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "grader-7b",
        "messages": [{"role": "system", "content": "You grade."},
                     {"role": "user", "content": "Q: p1 | A: last | ref: x | {braces} stay"}],
        "temperature": 0.0,
        "max_tokens": 64,
    }  # fmt: skip
    assert all(h["authorization"] == "Bearer sekrit" for h in server.headers)
    with pytest.raises(DataError, match=r"grpo.rewards\[0\].template reads \{reference\}, but"):
        Rewards([entry], workers=0)(["p"], ["seven"], {})  # no "answer" column


def test_a_500_is_retried_a_400_is_not_and_a_timeout_scores_0(stub):
    server = stub({
        "flaky": [500, "Score: 5"],
        "refused": [400, "Score: 9"],
        "down": [503],
        "slow": [("sleep", 2.0, "Score: 9")],
    })  # fmt: skip
    entry = _judge(server.url, timeout_s=0.5, retries=1, backoff_s=0.05)
    rewards = Rewards([entry], workers=0)
    try:
        total, metrics = rewards(
            ["p"] * 4, ["flaky", "refused", "down", "slow"], {"answer": [1] * 4}
        )
    finally:
        rewards.close()
    assert total == [0.5, 0.0, 0.0, 0.0]
    assert server.attempts == {"flaky": 2, "refused": 1, "down": 2, "slow": 2}
    assert metrics["reward/failures/judge/http_error"] == 2  # refused, and down after its retry
    assert metrics["reward/failures/judge/timeout"] == 1
    assert metrics["reward/failures"] == 3


def test_requests_are_in_flight_together(stub):
    keys = [f"c{i}" for i in range(8)]
    server = stub({k: [("sleep", 0.5, "Score: 4")] for k in keys})
    rewards = Rewards([_judge(server.url, max_concurrency=8)], workers=0)
    try:
        start = time.monotonic()
        total, _ = rewards(["p"] * 8, keys, {"answer": [0] * 8})
        took = time.monotonic() - start
    finally:
        rewards.close()
    assert total == pytest.approx([0.4] * 8)
    assert server.max_in_flight >= 4  # one at a time would take 4 s
    assert took < 2.5, took


def test_a_grpo_step_sums_the_judge_into_the_reward_and_logs_its_counts(stub, tmp_path):
    """`mindspeed grpo` with final_number and a judge (every reply "Score: 5"): one step's
    metrics hold the judge's mean 0.5, its failure counts (0) and a reward mean that is
    final_number's plus 0.5 x the judge's weight."""
    server = stub({"*": ["Score: 5"]})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(24, seed=3)))
    entry = f'{{judge: "{server.url}", model: m, template: "{TEMPLATE}", weight: 0.5}}'
    code = cli([
        "grpo", f"--data.prompts={prompts}", f"--data.tokenizer={ensure_demo_data().tokenizer}",
        "--data.eval_prompts=4", "--data.seq_len=48", "--grpo.n=4", "--grpo.max_new_tokens=3",
        "--grpo.reward_workers=0", f"--grpo.rewards=[final_number, {entry}]",
        "--train.global_batch=8", "--train.micro_batch=8", "--train.steps=1",
        "--model.ops_impl=reference", f"--logging.run_dir={tmp_path / 'run'}",
        "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
    ])  # fmt: skip
    assert code == 0
    [step] = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert step["reward/judge"] == 0.5
    assert step["reward/mean"] == pytest.approx(step["reward/final_number"] + 0.5 * 0.5)
    for cause in ("http_error", "timeout", "unparsed"):
        assert step[f"reward/failures/judge/{cause}"] == 0
    assert step["reward/failures"] == 0
    # the step's 8 samples; before and after training, 4 held-out prompts greedy and 4 x 4 sampled
    assert len(server.bodies) == 8 + 2 * (4 + 4 * 4)


BAD_ENTRIES = {
    '{judge: "htp:/127.0.0.1:8000", model: m}': "grpo.rewards[1].judge='htp:/127.0.0.1:8000' "
    "is not an http(s) URL",
    '{judge: "http://127.0.0.1:8000/v1", model: m, timeout: 5}': "grpo.rewards[1]: unknown key "
    "'timeout'; did you mean 'timeout_s'?",
    '{judge: "http://127.0.0.1:8000/v1"}': "grpo.rewards[1]: missing required field 'model'",
    '{judge: "http://127.0.0.1:8000/v1", model: m, template: "{prompt}"}': "grpo.rewards[1]."
    "template does not name {completion}",
    '{judge: "http://127.0.0.1:8000/v1", model: m, score_range: [10, 0]}': "grpo.rewards[1]."
    "score_range=[10.0, 0.0]",
    '{judge: "http://127.0.0.1:8000/v1", model: m, weight: .nan}': "grpo.rewards[1]: weight: "
    "expected a finite number, got nan",
    '{url: "http://127.0.0.1:8000/v1", model: m}': "grpo.rewards[1]: a reward mapping names its "
    "kind with one of 'judge: URL'",
}


@pytest.mark.parametrize("entry", list(BAD_ENTRIES))
def test_bad_judge_entries_are_one_line_on_the_command_line(entry, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli(["grpo", f"--grpo.rewards=[final_number, {entry}]", f"--logging.run_dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and BAD_ENTRIES[entry] in err and "\n" not in err, err
    assert "Traceback" not in err and not run_dir.exists()


def test_a_bad_judge_entry_in_a_yaml_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("grpo:\n  rewards:\n    - final_number\n"
                      "    - judge: http://127.0.0.1:8000/v1\n      modl: m\n")  # fmt: skip
    code = cli(["grpo", "--config", str(config), f"--logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "grpo.rewards[1]: unknown key 'modl'; did you mean 'model'?" in err


def test_the_readme_example_config_parses(tmp_path):
    """mindspeed-align's README shows a judge and a code entry: they load as written, and its
    regex is the default it says it is."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    block = readme.read_text().split("```yaml\ngrpo:\n  rewards:", 1)[1].split("```", 1)[0]
    (tmp_path / "run.yaml").write_text("grpo:\n  rewards:" + block)
    cfg = config_from_args(GRPOConfig, ["--config", str(tmp_path / "run.yaml")])
    rule, judge, code = reward_entries(cfg.grpo.rewards)
    assert rule == "final_number" and judge.score_regex == DEFAULT_SCORE_REGEX
    assert (judge.weight, judge.columns(), code.columns(), code.score) == (
        0.5,
        ["answer"],
        ["tests"],
        "all",
    )
