"""The LLM-judge reward (mindspeed-align) against our own OpenAI-compatible server, `mindspeed
serve` (mindspeed-tools) with a tiny random Llama: the protocol fits end to end. Each
completion's reward is the score a direct request to the server gives when its reply holds one
(read by hand here), else a counted parse failure scored 0; no request fails or times out."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from mindspeed_align.rl.rewards import Rewards
from mindspeed_core.testing import import_sibling

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("uvicorn")
serve_tests = import_sibling(
    str(ROOT / "packages/mindspeed-tools/tests/test_serve.py"), "test_serve"
)

TEMPLATE = "{prompt} {completion}"
COMPLETIONS = ["w30 w40", "w50", "w7 w8 w9"]


def _direct_reply(server, prompt: str, completion: str) -> str:
    """What the server answers the judge's request, asked with the standard library here."""
    body = {"model": server.model, "temperature": 0.0, "max_tokens": 8,
            "messages": [{"role": "user", "content": f"{prompt} {completion}"}]}  # fmt: skip
    request = urllib.request.Request(f"{server.url}/v1/chat/completions",
                                     json.dumps(body).encode(), {"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def test_judge_scores_through_mindspeed_serve(tmp_path):
    folder = tmp_path / "llama"
    chat_tests = serve_tests.chat_tests
    chat_tests.models_hf.make_hf("llama").save_pretrained(folder)
    chat_tests._save_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    server = serve_tests.Served(folder, "--max-batch", "4")
    common = {"judge": f"{server.url}/v1", "model": server.model, "template": TEMPLATE,
              "max_tokens": 8, "timeout_s": 60}  # fmt: skip
    # "Score: N" (the default) cannot appear in this model's words; w<N> can, in [0, 511]
    entries = [
        common,
        {**common, "name": "words", "score_regex": r"w(\d+)", "score_range": [0, 511]},
    ]
    rewards = Rewards(entries, workers=0)
    prompts = ["w10 w20"] * len(COMPLETIONS)
    try:
        total, metrics = rewards(prompts, COMPLETIONS, {"answer": [0] * len(COMPLETIONS)})
        replies = [_direct_reply(server, p, c) for p, c in zip(prompts, COMPLETIONS, strict=True)]
    finally:
        rewards.close()
        assert server.close() == 0
    words = [re.findall(r"w(\d+)", reply) for reply in replies]
    expected = [int(found[-1]) / 511 if found else 0.0 for found in words]
    assert total == pytest.approx(expected, abs=1e-12), replies
    assert metrics["reward/judge"] == 0 and metrics["reward/failures/judge/unparsed"] == len(
        COMPLETIONS
    )
    assert metrics["reward/failures/words/unparsed"] == sum(not found for found in words)
    for name in ("judge", "words"):  # the requests themselves all succeeded
        assert metrics[f"reward/failures/{name}/http_error"] == 0, metrics
        assert metrics[f"reward/failures/{name}/timeout"] == 0, metrics
    print(f"judge through mindspeed serve: replies {replies}, rewards {total}")
