"""The code-execution reward: the reply's last fenced Python block runs in the sandbox against
the record's tests. A correct reply scores 1, a wrong one 0, an infinite loop is killed at
the timeout and scores 0, a reply without a code block scores 0; `fraction` gives the share
of tests passed; a program that exits before the tests report scores 0."""

from __future__ import annotations

import pickle
import time

import pytest

from mindspeed_align.rl.code_reward import last_code_block
from mindspeed_align.rl.rewards import Rewards, required_columns
from mindspeed_core.cli import run as cli
from mindspeed_core.errors import DataError

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def _reply(body: str) -> str:
    return f"Here is my solution:\n```python\ndef add(a, b):\n    {body}\n```\nDone."


def test_correct_wrong_looping_and_missing_code_score_1_0_0_0():
    completions = [
        _reply("return a + b"),
        _reply("return a - b"),
        _reply("while True:\n        pass"),
        "def add(a, b): return a + b  (no fenced block)",
    ]
    rewards = Rewards([{"code": "tests", "timeout_s": 3}], workers=0)
    try:
        start = time.monotonic()
        total, metrics = rewards(["p"] * 4, completions, {"tests": [TESTS] * 4})
        took = time.monotonic() - start
    finally:
        rewards.close()
    assert total == [1.0, 0.0, 0.0, 0.0]
    assert metrics["reward/code"] == 0.25
    assert metrics["reward/code/timeouts"] == 0.25 and metrics["reward/code/no_code"] == 0.25
    assert metrics["reward/failures"] == 0 and metrics["reward/failures/code/error"] == 0
    assert took < 20, took  # the loop was killed at its 3 s, not left running


def test_fraction_a_test_program_the_last_block_and_an_early_exit():
    half = _reply("return a + b if a >= 0 else 7")  # passes tests 1 and 3 of 3
    two_blocks = "```python\ndef add(a, b):\n    return 0\n```\nbetter:\n```py\nadd = lambda a, b: a + b\n```"
    early_exit = _reply("return a + b\nimport os\nos._exit(0)")  # leaves before any test ran
    program = "def check(f):\n    assert f(1, 2) == 3\ncheck(add)\n"
    rewards = Rewards([{"code": "tests", "score": "fraction", "name": "unit"}], workers=0)
    try:
        total, metrics = rewards(
            ["p"] * 4, [half, two_blocks, early_exit, _reply("return a + b")],
            {"tests": [TESTS, TESTS, TESTS, program]},
        )  # fmt: skip
    finally:
        rewards.close()
    assert total == pytest.approx([2 / 3, 1.0, 0.0, 1.0])
    assert metrics["reward/unit"] == pytest.approx((2 / 3 + 2) / 4)
    assert last_code_block(two_blocks) == "add = lambda a, b: a + b\n"


def test_a_tests_field_of_the_wrong_type_is_a_counted_failure_and_a_missing_one_is_named():
    rewards = Rewards(["exact_match", {"code": "tests"}], workers=0)
    try:
        total, metrics = rewards(["p"], [_reply("return a + b")], {"tests": [42], "answer": ["x"]})
    finally:
        rewards.close()
    assert total == [0.0] and metrics["reward/failures/code/error"] == 1
    assert metrics["reward/failures"] == 1
    rewards = Rewards([{"code": "tests"}], workers=0)
    with pytest.raises(
        DataError, match=r"grpo.rewards\[0\]: the prompt records have no 'tests' field"
    ):
        rewards(["p"], [_reply("return a + b")], {"answer": ["x"]})
    assert required_columns(["exact_match", {"code": "tests"}]) == {"answer": "exact_match",
                                                                     "tests": "code"}  # fmt: skip


def test_the_ray_reward_role_scores_a_code_entry_from_a_pickled_section():
    """The Ray reward actor's class, given the section as Ray ships it (pickled), scores
    through the same `section_rewards` path as the trainer (no Ray cluster started here)."""
    from mindspeed_align.rl.config import GRPOSection
    from mindspeed_align.rl.placement import _RewardWorker
    from mindspeed_llm.demo import ensure_demo_data

    section = pickle.loads(pickle.dumps(GRPOSection(rewards=[{"code": "tests", "weight": 2.0}])))
    worker = _RewardWorker(section, ensure_demo_data().tokenizer)
    try:
        total, metrics = worker.score(["p", "p"], [_reply("return a + b"), _reply("return 0")],
                                      {"tests": [TESTS, TESTS]})  # fmt: skip
    finally:
        worker.close()
    assert total == [2.0, 0.0] and metrics["reward/code"] == 0.5


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            "{code: tests, score: most}",
            "grpo.rewards[0]: score: expected one of ['all', 'fraction']",
        ),
        ("{code: tests, timeout_s: 0}", "grpo.rewards[0].timeout_s=0.0 must be > 0"),
        ("{code: tests, judge: 'http://127.0.0.1:8000/v1'}", "names its kind with one of"),
    ],
)
def test_bad_code_entries_are_one_line(entry, expected, tmp_path, capsys):
    code = cli(["grpo", f"--grpo.rewards=[{entry}]", f"--logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()
