"""Rule rewards: the built-ins, weights, and misbehaving functions in worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_align.rl.rewards import Rewards, exact_match, final_number, load_reward
from mindspeed_core.errors import ConfigError

FIXTURES = "rl_reward_fixtures"


def test_builtin_rewards_and_weights():
    answers = {"answer": [7, 7, "12", 3]}
    completions = [" 7.", "7 apples", "it is 12", "three"]
    assert exact_match([""] * 4, completions, **answers) == [1.0, 0.0, 0.0, 0.0]
    assert final_number([""] * 4, completions, **answers) == [1.0, 1.0, 1.0, 0.0]
    rewards = Rewards(["exact_match", "final_number"], [2.0, 0.5], workers=0)
    total, metrics = rewards([""] * 4, completions, answers)
    assert total == [2.5, 0.5, 0.5, 0.0]
    assert metrics["reward/exact_match"] == 0.25 and metrics["reward/failures"] == 0
    with pytest.raises(ConfigError, match="nope"):
        load_reward("mindspeed_align.rl.rewards:nope")
    with pytest.raises(ConfigError, match="2 values for 1"):
        Rewards(["exact_match"], [1.0, 2.0])


def test_raising_and_hanging_rewards_are_counted_and_the_run_goes_on(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the spawned workers import it
    rewards = Rewards([f"{FIXTURES}:raises", f"{FIXTURES}:hangs"], workers=2, timeout_s=3.0)
    try:
        total, metrics = rewards(["p"] * 3, ["ok", "boom", "hang"], {})
        # raises: 1, 0 (raised), 1; hangs: 0.5, 0.5, 0 (timed out)
        assert total == [1.5, 0.5, 1.0]
        assert metrics["reward/failures"] == 2
        total, metrics = rewards(["p"], ["fine"], {})  # fresh workers after the hang
        assert total == [1.5] and metrics["reward/failures"] == 0
    finally:
        rewards.close()
    in_process = Rewards([f"{FIXTURES}:raises"], workers=0)
    assert in_process(["p"], ["boom"], {}) == ([0.0], {"reward/raises": 0.0, "reward/failures": 1})
