"""`train.micro_batch_tokens` in GRPO's and PPO's updates: the step's samples packed whole
into micro-batches of the budget (as many as the budget needs, the most any rank needs)
give the losses, gradient norms, KL and rewards of the `accum` micro-batches of
`train.micro_batch` samples on the same rollouts; a budget below the longest sample is
one line, exit 2."""

from __future__ import annotations

import json
import re

import pytest

from mindspeed_align.rl.cli import main, ppo_main
from mindspeed_align.rl.data import demo_records
from mindspeed_align.rl.grpo import GRPOStep
from mindspeed_core.cli import guarded
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.demo import ensure_demo_data

grpo_tests = import_sibling(__file__, "test_rl_grpo")
ppo_tests = import_sibling(__file__, "test_rl_ppo")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl-budget")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(40, seed=7)))
    return folder, prompts, ensure_demo_data().tokenizer


def _spy_rows(monkeypatch):
    """How many micro-batches each `_rows` call made."""
    counts, rows = [], GRPOStep._rows

    def spied(self, batch, keep):
        out = rows(self, batch, keep)
        counts.append(len(out))
        return out

    monkeypatch.setattr(GRPOStep, "_rows", spied)
    return counts


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_budget_updates_equal_fixed_micro_batches(task, monkeypatch, command):
    run, args = (main, grpo_tests._args) if command == "grpo" else (ppo_main, ppo_tests._args)
    steps = ["--train.steps=2", "--train.micro_batch=8"]  # 16 samples: 2 micro-batches of 8
    assert guarded(run, args(task, f"{command}-fixed", *steps)) == 0
    counts = _spy_rows(monkeypatch)
    assert (
        guarded(run, args(task, f"{command}-budget", *steps, "--train.micro_batch_tokens=60")) == 0
    )
    print("micro-batches per _rows call", counts)
    assert counts and max(counts) > 2  # more, smaller micro-batches than the 2 of 8 samples
    fixed = read_metrics(task[0] / f"{command}-fixed" / "metrics.jsonl")
    budget = read_metrics(task[0] / f"{command}-budget" / "metrics.jsonl")
    assert len(fixed) == len(budget) == 2
    for a, b in zip(fixed, budget, strict=True):
        for key in ("loss", "grad_norm", "kl", "reward/mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_budget_below_the_longest_sample_is_one_line(task, capsys):
    capsys.readouterr()
    args = grpo_tests._args(
        task, "bad", "--train.micro_batch_tokens=40", "--grpo.shared_prompts=off"
    )
    assert guarded(main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"train.micro_batch_tokens=40 is below data.seq_len=48", err), err
    args = grpo_tests._args(task, "bad", "--train.micro_batch_tokens=50")  # shared_prompts auto
    assert guarded(main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"train.micro_batch_tokens=50 is below a prompt's group .* = 57\)", err), err


def _grpo_dp_shard(task):
    """On 2 ranks: GRPO with 2 micro-batches of 4 samples a rank, then with the budget."""
    steps = ["--train.steps=2", "--train.micro_batch=4", "--parallel.dp_shard=2"]
    codes = [guarded(main, grpo_tests._args(task, "dp-fixed", *steps)),
             guarded(main, grpo_tests._args(task, "dp-budget", *steps, "--train.micro_batch_tokens=60"))]  # fmt: skip
    return codes


@pytest.mark.distributed
def test_budget_under_dp_shard_equals_fixed_micro_batches(task):
    """Each rank packs its own rollouts; the ranks agree on the count (the most any needs)."""
    from mindspeed_core.testing import run_distributed

    assert run_distributed(_grpo_dp_shard, 2, task, timeout=600) == [[0, 0], [0, 0]]
    fixed = read_metrics(task[0] / "dp-fixed" / "metrics.jsonl")
    budget = read_metrics(task[0] / "dp-budget" / "metrics.jsonl")
    assert len(fixed) == len(budget) == 2
    for a, b in zip(fixed, budget, strict=True):
        for key in ("loss", "grad_norm", "kl", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
