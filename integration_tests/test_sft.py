"""`mindspeed sft` end to end: the embedded demo learns its task, packed SFT under
context parallel, pipeline parallel and recompute gives one process's losses, resume is
exact, and a `mindspeed
preprocess` prefix trains exactly like the raw file it came from.

All on the embedded demo task (generated into the session cache on first use).
"""

import re
import subprocess
import sys

import pytest

from mindspeed_core.training import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SHORT = ["--train.steps=8", "--train.micro_batch=2", "--train.global_batch=8",
         "--data.seq_len=96", "--train.eval_interval=4", "--logging.log_interval=1",
         "--logging.progress=false", "--logging.tensorboard=false",
         "--checkpoint.interval=0", "--optim.warmup_steps=2"]  # fmt: skip


def _losses(run_dir, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(run_dir / "metrics.jsonl") if key in r}


def _torchrun(env, nproc, run_dir, *args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "mindspeed_llm.sft", *SHORT,
           f"--logging.run_dir={run_dir}", *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return _losses(run_dir)


def test_the_demo_learns_its_task(mindspeed, tmp_path):
    """`mindspeed sft` with no arguments (but the run directory): exact match on held-out
    questions goes from under 20% to over 80%."""
    done = mindspeed("sft", f"--logging.run_dir={tmp_path / 'demo'}", "--logging.progress=false",
                     timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = re.search(r"held-out exact match: (\d+)% before, (\d+)% after", done.stderr)
    assert found, done.stderr[-2000:]
    before, after = int(found[1]), int(found[2])
    assert before < 20 and after > 80, (before, after)
    losses = _losses(tmp_path / "demo")
    assert losses[max(losses)] < 0.1 < losses[min(losses)]


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft-straight")
    return run, _torchrun(env, 1, run)


def test_cp_pp_recompute_and_resume_equal_one_straight_run(env, straight, tmp_path):
    run, reference = straight
    assert sorted(reference) == list(range(1, 9))
    cp = _torchrun(env, 2, tmp_path / "cp", "--parallel.cp=2")
    for step, loss in reference.items():
        assert cp[step] == pytest.approx(loss, rel=1e-4), step
    for name, layout in (("pp", ["--parallel.pp=2"]), ("ac", ["--train.ac=full"])):
        losses = _torchrun(env, 2 if name == "pp" else 1, tmp_path / name, *layout)
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-4), (name, step)
    _torchrun(env, 1, tmp_path / "resumed", "--train.exit_at_step=4")
    resumed = _torchrun(env, 1, tmp_path / "resumed")
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), step
    assert _losses(tmp_path / "resumed", "valid_loss") == pytest.approx(_losses(run, "valid_loss"))


def test_a_preprocess_prefix_trains_like_its_raw_file(mindspeed, env, straight, tmp_path, cache):
    demo = cache / "sft-demo-v1"
    tokenizer, template = cache / "demo-v1" / "tokenizer.model", demo / "template.jinja"
    done = mindspeed("preprocess", "--input", demo / "train.jsonl", "--output-prefix",
                     tmp_path / "demo", "--tokenizer", tokenizer, "--chat-template", template,
                     "--handler-name", "AlpacaStyleInstructionHandler", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "demo_packed_labels_document.idx").is_file()
    args = [f"--data.paths=[{tmp_path / 'demo'}]", f"--data.tokenizer={tokenizer}",
            f"--data.chat_template={template}"]  # fmt: skip
    from_prefix = _torchrun(env, 1, tmp_path / "prefix", *args)
    assert from_prefix == pytest.approx(straight[1], rel=1e-6)
