"""Rule rewards: the built-ins, weights, and misbehaving functions in worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_align.rl.rewards import Rewards, exact_match, final_number, load_reward
from mindspeed_core.errors import ConfigError
from mindspeed_core.testing.processes import alive, descendants, gone_within

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


@pytest.mark.parametrize("workers", [0, 2])
def test_nan_and_wrong_counts_are_counted_failures_with_one_warning(workers, monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    rewards = Rewards([f"{FIXTURES}:nan_for_odd", f"{FIXTURES}:one_score_too_many"],
                      workers=workers)  # fmt: skip
    try:
        with caplog.at_level("WARNING", logger="mindspeed.rl"):
            total, metrics = rewards(["p"] * 4, ["even", "odd", "even", "odd"], {})
    finally:
        rewards.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one per function and call, not one per completion
    if workers:  # one completion at a time: the NaN ones fail, and every too-long answer
        assert total == [1.0, 0.0, 1.0, 0.0] and metrics["reward/failures"] == 2 + 4
        assert "2 of 4 completions failed (first: returned nan)" in lines[0]
    else:  # the whole call is refused
        assert total == [0.0] * 4 and metrics["reward/failures"] == 8
        assert "4 of 4 completions failed (first: returned nan)" in lines[0]
    assert ("returned 2 scores for 1 completions" if workers else "returned 5 scores for 4") in lines[1]


def _reward_model_folder(folder: Path, tokenizer: Path) -> Path:
    """A random debug-Llama reward model exported as transformers' sequence classifier."""
    import torch

    from mindspeed_align.reward import add_score_head, export_classifier
    from mindspeed_llm.models import build_model_config, get_model_spec

    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    torch.manual_seed(0)
    model = get_model_spec("llama").build(config)
    add_score_head(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return export_classifier(state, config, folder / "rm", pad_token_id=0, tokenizer=tokenizer)


def test_a_reward_model_scores_as_transformers_and_joins_the_sum(tmp_path):
    """`grpo.reward_model`: our packed scoring of prompt + completion equals transformers'
    AutoModelForSequenceClassification on the same ids; its weighted score joins the rules'."""
    import torch

    from mindspeed_align.rl.reward_model import RewardModel
    from mindspeed_llm.demo import ensure_demo_data
    from mindspeed_llm.tokenizer import load_tokenizer

    tokenizer_path = ensure_demo_data().tokenizer
    folder = _reward_model_folder(tmp_path, tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    model = RewardModel(folder, tokenizer, row_tokens=24)  # several packed rows
    prompts = ["alice had three red apples. 3 plus 2 is", "bob went to the park. 1 plus 1 is"] * 2
    completions = [" 5.", " 2", " 7 and", " nothing"]
    scores = model(prompts, completions)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32
    )
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([tokenizer.encode(p + c)])).logits[0, 0].item()
                for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
    assert scores == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 4  # the scores tell the texts apart
    rewards = Rewards(["final_number"], workers=0, model=model, model_weight=0.5)
    total, metrics = rewards(prompts, completions, {"answer": [5, 2, 5, 2]})
    assert total == pytest.approx([1 + 0.5 * scores[0], 1 + 0.5 * scores[1], 0.5 * scores[2],
                                   0.5 * scores[3]])  # fmt: skip
    assert metrics["reward/model"] == pytest.approx(sum(scores) / 4)


def test_a_reward_model_folder_that_is_not_one_is_named(tmp_path):
    import json

    from mindspeed_align.rl.reward_model import RewardModel

    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"ppo.reward_model: .*lm: not a Hugging Face "
                                          r"\*ForSequenceClassification folder \(architectures: "
                                          r"\['LlamaForCausalLM'\]\)"):  # fmt: skip
        RewardModel(tmp_path / "lm", None, what="ppo.reward_model")
    with pytest.raises(ConfigError, match="grpo.reward_model: no folder"):
        RewardModel(tmp_path / "missing", None)


def test_math_verify_reward_judges_equal_math():
    """The `math_verify` built-in (math-verify): equal values in other spellings score 1."""
    pytest.importorskip("math_verify")
    from mindspeed_align.rl.rewards import math_verify

    completions = ["so the answer is $\\frac{1}{2}$", "we get \\boxed{12}", "it is 13", "x = 0.5"]
    assert math_verify([""] * 4, completions, answer=["0.5", "12", "12", "1/2"]) == [
        1.0,
        1.0,
        0.0,
        1.0,
    ]
    assert load_reward("math_verify") is math_verify


def test_math_verify_without_its_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real(name, *a))  # fmt: skip
    with pytest.raises(ConfigError, match=r"math_verify needs the math-verify package"):
        load_reward("math_verify")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_reward_workers_die_with_a_killed_trainer(how):
    # The trainer's process holds a reward pool (workers + multiprocessing's resource tracker);
    # killed without any cleanup, it must leave nothing running (mindspeed_core.lifeline).
    script = (
        "import time; from mindspeed_align.rl.rewards import Rewards\n"
        "r = Rewards(['exact_match'], workers=2)\n"
        "assert r(['p', 'q'], ['1', '2'], {'answer': [1, 3]})[0] == [1.0, 0.0]\n"
        "print('ready', flush=True); time.sleep(600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        helpers = descendants(trainer.pid)
        assert len(helpers) >= 2, helpers
        os.kill(trainer.pid, getattr(signal, how))
        trainer.wait(timeout=30)
        assert gone_within(helpers, 5.0) is not None, alive(helpers)
    finally:
        trainer.kill()
        for pid, _ in alive(helpers if "helpers" in locals() else []):
            os.kill(pid, signal.SIGKILL)
