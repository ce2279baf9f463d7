"""`mindspeed pretrain` end to end: layouts agree, resume is exact, bad input is one line.

Runs the real entry point with torchrun on CPU (gloo) and compares the losses the
runs write to metrics.jsonl. The demo corpus is built once per session into a
temporary cache (conftest.py).
"""

import json
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
RTOL = 1e-4  # fp32; different layouts reduce in different orders
STEPS = 20  # conftest's PRETRAIN_ARGS: 20 steps, validation at 10 and 20


def _losses(records, key="loss"):
    return {r["step"]: r[key] for r in records if key in r}


def _assert_close(got: dict, want: dict, steps):
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=RTOL), (step, got[step], want[step])


@pytest.fixture(scope="module")
def straight(torchrun, tmp_path_factory):
    """One process, 20 steps without interruption: the reference."""
    run = tmp_path_factory.mktemp("straight")
    records = torchrun(1, run)
    return run, records


def test_the_straight_run_learns_and_fills_its_run_directory(straight):
    run, records = straight
    losses = _losses(records)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5
    assert set(_losses(records, "valid_loss")) == {10, 20}
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb"):
        assert all(key in r for r in records), key
    assert (run / "config.yaml").is_file() and (run / "loss_curve.png").stat().st_size > 1000
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        # tp and dp_shard alone: slow (the combined layout in CI runs both)
        pytest.param(2, ["--parallel.tp=2"], marks=pytest.mark.slow),
        pytest.param(2, ["--parallel.dp_shard=2"], marks=pytest.mark.slow),
        (4, ["--parallel.tp=2", "--parallel.dp_shard=2"]),
    ],
    ids=["tp2", "dp_shard2", "tp2_dp_shard2"],
)
def test_layouts_give_the_losses_of_one_process(straight, torchrun, tmp_path, nproc, layout):
    records = torchrun(nproc, tmp_path / "run", *layout)
    _assert_close(_losses(records), _losses(straight[1]), range(1, STEPS + 1))
    _assert_close(_losses(records, "valid_loss"), _losses(straight[1], "valid_loss"), (10, 20))


def test_resume_continues_exactly_in_the_same_and_another_layout(straight, torchrun, tmp_path):
    run = tmp_path / "run"
    first = torchrun(1, run, "--train.exit_at_step=10")
    assert max(_losses(first)) == 10
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_10"
    other = tmp_path / "other"  # a new run in another layout, starting from that checkpoint
    resumed_elsewhere = torchrun(
        2, other, "--parallel.tp=2", f"--checkpoint.load={run / 'checkpoints' / 'step_10'}"
    )
    resumed = torchrun(1, run)  # the same run again: picks up checkpoints/latest
    want = _losses(straight[1])
    _assert_close(_losses(resumed), want, range(1, STEPS + 1))
    _assert_close(_losses(resumed_elsewhere), want, range(11, STEPS + 1))
    assert min(_losses(resumed_elsewhere)) == 11


# -- bad input: one line, exit code 2, nothing written ---------------------------------


def _assert_user_error(done, *fragments, tmp_path):
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def demo(cache, straight):
    """The demo corpus the straight run built: tokenizer and dataset prefix."""
    folder = next(cache.glob("demo-*"))
    return folder / "tokenizer.model", folder / "demo_text_document"


def _copy_dataset(demo, tmp_path) -> Path:
    prefix = tmp_path / "data" / "corpus"
    prefix.parent.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(f"{demo[1]}{ext}", f"{prefix}{ext}")
    return prefix


def test_a_missing_data_path_is_named(pretrain_cli, tmp_path, demo):
    missing = tmp_path / "nowhere" / "corpus"
    done = pretrain_cli(
        tmp_path / "run", f"--data.paths=[{missing}]", f"--data.tokenizer={demo[0]}"
    )
    _assert_user_error(done, str(missing), tmp_path=tmp_path)


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (
            lambda p: Path(f"{p}.idx").write_bytes(b"NOTMMIDX" + Path(f"{p}.idx").read_bytes()[8:]),
            ".idx",
        ),
        (lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes()[:40]), ".idx"),
        (lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes()[:-100]), ".bin"),
    ],
    ids=["bad_magic", "truncated_idx", "short_bin"],
)
def test_a_damaged_dataset_is_named(pretrain_cli, tmp_path, demo, damage, fragment):
    prefix = _copy_dataset(demo, tmp_path)
    damage(prefix)
    done = pretrain_cli(tmp_path / "run", f"--data.paths=[{prefix}]", f"--data.tokenizer={demo[0]}")
    _assert_user_error(done, f"{prefix}{fragment}", tmp_path=tmp_path)


def test_configuration_mistakes_are_named(pretrain_cli, tmp_path, demo):
    done = pretrain_cli(tmp_path / "run", "--train.global_batch=7")
    _assert_user_error(done, "train.global_batch=7 is not divisible", tmp_path=tmp_path)
    empty = tmp_path / "no-checkpoints"
    done = pretrain_cli(tmp_path / "run", f"--checkpoint.load={empty}")
    _assert_user_error(done, f"checkpoint.load={empty} holds no checkpoint", tmp_path=tmp_path)
    done = pretrain_cli(tmp_path / "run", "--data.seq_len=100000")
    _assert_user_error(
        done, "data.seq_len=100000 exceeds", "max_position_embeddings", tmp_path=tmp_path
    )
    done = pretrain_cli(tmp_path / "run", "--optim.name=sgd")
    _assert_user_error(done, "optim.name", "'adamw', 'muon'", "got 'sgd'", tmp_path=tmp_path)
    done = pretrain_cli(tmp_path / "run", "--model.family=gemma2",
                        "--train.fused_linear_cross_entropy=on")  # fmt: skip
    _assert_user_error(done, "train.fused_linear_cross_entropy=on cannot run here",
                       "logit softcapping", tmp_path=tmp_path)  # fmt: skip


def test_a_tokenizer_larger_than_the_model_is_refused(pretrain_cli, tmp_path, demo):
    config = tmp_path / "small" / "config.json"  # a Hugging Face config with 256 tokens
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
            }
        )
    )
    done = pretrain_cli(tmp_path / "run", f"--model.hf_config={config.parent}")
    _assert_user_error(done, str(demo[0]), "512 tokens", "vocab_size is 256", tmp_path=tmp_path)


def test_the_demo_checkpoint_generates(straight, mindspeed):
    """`mindspeed generate` on a demo run's checkpoints finds the demo tokenizer itself."""
    run, _ = straight
    done = mindspeed(
        "generate", "--model", run / "checkpoints", "alice had", "--max-new-tokens", "8"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["prompt"] == "alice had" and 1 <= len(record["token_ids"]) <= 8
    assert record["completion"].strip()


@pytest.mark.slow
def test_the_demo_says_its_speed_before_and_after_its_first_checkpoint(env, tmp_path):
    """`mindspeed pretrain` as a user runs it (two OpenMP threads): its last line gives the
    tokens/s over steps 30-90 and 110-300. On a quiet machine the two agree within 15%
    (the step-100 checkpoint used to cut the speed to 0.56x for the rest of the run: the
    cause is tested in mindspeed-core's test_checkpoint.py); under load only the line is."""
    import os
    import subprocess
    import sys

    run_env = {**env, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "pretrain", f"--logging.run_dir={tmp_path / 'run'}",
           "--logging.progress=false", "--logging.tensorboard=false"]  # fmt: skip
    quiet = os.getloadavg()[0] < 0.5
    done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    quiet = quiet and os.getloadavg()[0] < 2.5  # the run's own two threads
    last = done.stderr.strip().splitlines()[-1]
    match = re.search(r"tokens/s ([\d,]+) over steps 30-90, ([\d,]+) over steps 110-300", last)
    assert match, last
    before, after = (float(g.replace(",", "")) for g in match.groups())
    print(f"pretrain demo: {before:,.0f} tokens/s over steps 30-90, {after:,.0f} over 110-300 "
          f"({'quiet' if quiet else 'loaded'} machine)")  # fmt: skip
    if quiet:
        assert abs(after / before - 1) <= 0.15, last
