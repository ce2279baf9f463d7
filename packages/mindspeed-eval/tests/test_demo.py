"""The embedded default: `mindspeed eval` with no arguments trains the pretrain demo when
its checkpoints are missing, then scores it on generated questions about the demo's
stories, far above chance (slow: it trains); the questions themselves (fast)."""

import json
from collections import Counter

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_eval.tasks import get_task


def test_demo_questions_are_fair_multiple_choice():
    items = get_task("demo").load(None, shots=0, fewshot=None)
    assert Counter(i.subject for i in items) == {"sum": 40, "together": 40, "thanks": 40}
    for item in items:
        assert len(set(item.choices)) == 4 and item.target in "ABCD"
    assert len({i.target for i in items}) == 4  # the right answer is not always first
    assert items == get_task("demo").load(None, shots=0, fewshot=None)  # same every run


@pytest.mark.slow
def test_default_eval_trains_and_scores_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    assert cli(["eval", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "demo (ppl, 0-shot) on runs/pretrain/checkpoints" in printed
    result = json.loads((tmp_path / "runs/eval/demo_results.json").read_text())
    assert result["metrics"]["chance"] == 0.25
    assert result["metrics"]["accuracy"] > 0.8  # trained: far above guessing
