"""`mindspeed pretrain` of a MoE model: expert parallel over 2 processes gives the losses of
one process, router statistics reach metrics.jsonl, a checkpoint saved with ep=2 resumes
in one process exactly and converts to a transformers Mixtral with the same logits, and a
bad ep is one line."""

import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_core.testing import import_sibling

pretrain = import_sibling(__file__, "test_pretrain")
pytestmark = pytest.mark.distributed
STEPS = 6
MIXTRAL = [
    "--model.family=mixtral",
    "--model.flavor=debug",
    f"--train.steps={STEPS}",
    "--train.eval_interval=3",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mindspeed-cache")


@pytest.fixture(scope="module")
def one(cache, tmp_path_factory):
    """One process, no interruption: the reference."""
    return pretrain._torchrun(cache, 1, tmp_path_factory.mktemp("one"), *MIXTRAL)


def test_ep2_gives_the_losses_of_one_process_and_logs_router_statistics(cache, tmp_path, one):
    ep2 = pretrain._torchrun(cache, 2, tmp_path / "ep2", *MIXTRAL, "--parallel.ep=2")
    losses = pretrain._losses(one)
    assert sorted(losses) == list(range(1, STEPS + 1))
    pretrain._assert_close(pretrain._losses(ep2), losses, range(1, STEPS + 1))
    valid = pretrain._losses(one, "valid_loss")
    pretrain._assert_close(pretrain._losses(ep2, "valid_loss"), valid, (3, 6))
    pretrain._assert_close(
        pretrain._losses(ep2, "moe_aux_loss"),
        pretrain._losses(one, "moe_aux_loss"),
        range(1, STEPS + 1),
    )
    for record in ep2:
        load = record["moe_load"]  # (layers, experts) fractions of the step's assignments
        assert len(load) == 2 and all(len(row) == 4 for row in load)
        assert all(sum(row) == pytest.approx(1.0, abs=1e-3) for row in load)
        assert record["moe_max_load"] >= 1.0 >= record["moe_min_load"] >= 0.0
        assert record["moe_aux_loss"] > 0 and record["moe_dropped_tokens"] == 0
    assert [r["moe_load"] for r in ep2] == [r["moe_load"] for r in one]


@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_in_one_process(cache, tmp_path, one):
    run = tmp_path / "ep2"
    first = pretrain._torchrun(cache, 2, run, *MIXTRAL, "--parallel.ep=2", "--train.exit_at_step=3")
    assert max(pretrain._losses(first)) == 3
    step_3 = run / "checkpoints" / "step_3"
    resumed = pretrain._torchrun(
        cache, 1, tmp_path / "one", *MIXTRAL, f"--checkpoint.load={step_3}"
    )
    assert min(pretrain._losses(resumed)) == 4
    pretrain._assert_close(pretrain._losses(resumed), pretrain._losses(one), range(4, STEPS + 1))
    _converts_to_transformers(cache, step_3, tmp_path / "hf")


def _converts_to_transformers(cache, checkpoint, out):
    """The ep=2 checkpoint -> `mindspeed convert --to hf` -> transformers' Mixtral, same logits."""
    import torch
    import transformers

    from mindspeed_llm.models.hf_io import load_model

    exe = Path(sys.executable).with_name("mindspeed")
    cmd = [str(exe), "convert", "--input", str(checkpoint), "--output", str(out), "--to", "hf"]
    done = subprocess.run(
        cmd, env=pretrain._env(cache), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ours, config = load_model(checkpoint)
    assert type(hf).__name__ == "MixtralForCausalLM" and config.num_experts == 4
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf.eval()(ids).logits, atol=1e-5, rtol=0)


def test_ep_not_dividing_the_data_ranks_is_one_line(cache, tmp_path):
    done = pretrain._cli(cache, tmp_path, *MIXTRAL, "--parallel.ep=2")
    pretrain._assert_user_error(done, "ep=2 must divide dp_shard x cp = 1", tmp_path=tmp_path)
