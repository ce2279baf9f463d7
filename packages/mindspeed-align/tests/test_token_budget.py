"""`train.micro_batch_tokens` in the DPO family, RM and PRM: three steps with the budget's
packed micro-batches give the losses, metrics and gradient norms of the fixed-row
micro-batches (`train.micro_batch` rows) on the same samples; KTO, whose KL term pairs an
example with its micro-batch neighbour, refuses the budget in one line."""

import json
import re

import pytest
import torch

from mindspeed_align.dpo import dpo
from mindspeed_align.dpo_config import DPOConfig
from mindspeed_align.kto import main as kto_main
from mindspeed_align.pairs import PairData
from mindspeed_align.prm import PRMConfig, prm
from mindspeed_align.rm import RMConfig, rm
from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.sft_data import SFTData

test_dpo = import_sibling(__file__, "test_dpo")
test_prm = import_sibling(__file__, "test_prm")

FIXED = ["--train.micro_batch=2", "--train.global_batch=6"]  # 3 micro-batches of 2 rows
BUDGET = ["--train.micro_batch=2", "--train.global_batch=6", "--train.micro_batch_tokens=200"]


def _steps(run, config, folder, data, run_dir, *extra):
    args = test_dpo.run_args(folder, data, run_dir, "--train.steps=3", *extra)
    run(load_config(config, None, args))
    return read_metrics(run_dir / "metrics.jsonl")


def _spy(monkeypatch, cls):
    """The shapes of the batches `cls.collate_budget` makes."""
    shapes, collate = [], cls.collate_budget

    def spied(self, groups):
        batches = collate(self, groups)
        shapes.extend(tuple(b["input_ids"].shape) for b in batches)
        return batches

    monkeypatch.setattr(cls, "collate_budget", spied)
    return shapes


def _assert_packed(shapes, steps=3):
    """Each training step's 6 units packed into fewer micro-batches, each one row within
    the budget (validation is off)."""
    assert shapes and len(shapes) < 3 * steps, shapes
    assert all(rows == 1 and width <= 200 for rows, width in shapes), shapes


def _assert_same(fixed, budget, keys):
    assert len(fixed) == len(budget) == 3
    for key in keys:
        torch.testing.assert_close([m[key] for m in budget], [m[key] for m in fixed],
                                   rtol=1e-5, atol=1e-6, msg=key)  # fmt: skip
    # the budget packed several pairs into each micro-batch: tokens per rank are logged
    assert all(m["rank_tokens_max"] == m["rank_tokens_min"] > 0 for m in budget)


@pytest.mark.parametrize("ref", ["precompute", "model"])
def test_dpo_budget_equals_fixed_rows(tmp_path, monkeypatch, ref):
    folder, data = test_dpo.make_inputs(tmp_path, n=12)
    extra = [f"--dpo.ref={ref}"]
    fixed = _steps(dpo, DPOConfig, folder, data, tmp_path / "fixed", *FIXED, *extra)
    shapes = _spy(monkeypatch, PairData)
    budget = _steps(dpo, DPOConfig, folder, data, tmp_path / "budget", *BUDGET, *extra)
    _assert_packed(shapes)
    _assert_same(fixed, budget, ("loss", "rewards/chosen", "rewards/margins", "grad_norm"))
    assert fixed[-1]["loss"] < fixed[0]["loss"]


def test_rm_and_prm_budget_equal_fixed_rows(tmp_path, monkeypatch):
    folder, data = test_dpo.make_inputs(tmp_path / "rm", n=12)
    fixed = _steps(rm, RMConfig, folder, data, tmp_path / "rm" / "fixed", *FIXED)
    shapes = _spy(monkeypatch, PairData)
    budget = _steps(rm, RMConfig, folder, data, tmp_path / "rm" / "budget", *BUDGET)
    _assert_packed(shapes)
    _assert_same(fixed, budget, ("loss", "grad_norm", "accuracy"))
    folder, data = test_prm.make_inputs(tmp_path / "prm", n=12)
    fixed = _steps(prm, PRMConfig, folder, data, tmp_path / "prm" / "fixed", *FIXED)
    shapes = _spy(monkeypatch, SFTData)
    budget = _steps(prm, PRMConfig, folder, data, tmp_path / "prm" / "budget", *BUDGET)
    _assert_packed(shapes)
    _assert_same(fixed, budget, ("loss", "grad_norm", "accuracy"))


def test_kto_refuses_the_budget_in_one_line(tmp_path, capsys):
    folder, _ = test_dpo.make_inputs(tmp_path, n=4)
    data = tmp_path / "kto.jsonl"
    rows = [
        {"prompt": f"user {i} asks", "completion": f"answer {i}", "label": i % 2 == 0}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    args = test_dpo.run_args(folder, data, run_dir, "--train.micro_batch_tokens=128")
    capsys.readouterr()
    assert guarded(kto_main, args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    assert re.search(
        r"^error: train.micro_batch_tokens=128: KTO's KL term", err.splitlines()[-1]
    ), err
    assert not (run_dir / "metrics.jsonl").exists()
