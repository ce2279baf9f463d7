"""The worked method of docs/architecture.md and the llm README (`examples/kl_sft.py`,
KL-regularised SFT written on public names only) trains through `Objective.setup`,
checkpoints and resumes exactly, and its loss is nll + beta * KL as its metrics report them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mindspeed_core.training import read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kl_sft.py"


def _example():
    spec = importlib.util.spec_from_file_location("kl_sft", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(example, run_dir: Path, *extra) -> list[dict]:
    args = ["--train.steps=6", "--optim.warmup_steps=1", "--optim.lr=3e-3", "--train.eval_interval=0",
            "--checkpoint.interval=3", "--logging.log_interval=1", "--logging.progress=false",
            f"--logging.run_dir={run_dir}", *extra]  # fmt: skip
    assert example.main(args) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def test_the_worked_method_trains_checkpoints_and_resumes_exactly(tmp_path):
    example = _example()
    whole = _run(example, tmp_path / "whole")
    assert whole[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert whole[-1]["kl"] > 1e-3  # then it moves away, and the KL says so
    for m in whole:  # the loss is the method's: nll + beta * kl, means over supervised tokens
        assert m["loss"] == pytest.approx(m["nll"] + 0.1 * m["kl"], rel=1e-5)
    assert whole[-1]["nll"] < whole[0]["nll"]  # it learns
    _run(example, tmp_path / "resumed", "--train.exit_at_step=3")
    resumed = _run(example, tmp_path / "resumed")  # the reference is rebuilt, the rest loaded
    keys = ("step", "loss", "nll", "kl", "grad_norm")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in whole]


def test_the_docs_show_the_example_as_it_is():
    """The method's class in the llm README is the file's, line for line."""
    source = EXAMPLE.read_text()
    start = source.index("class KLRegularisedSFT")
    method = source[start : source.index("\n\n\ndef main", start)]
    assert method in (ROOT / "packages/mindspeed-llm/README.md").read_text()
    assert len(source.splitlines()) <= 80
