"""Long sequences through `mindspeed pretrain` on CPU: a tiny Llama with a 32k context (from a
config.json, as a user would bring one) trains 8k-token sequences under ring context parallel
with the losses of one process, and 32k-token sequences under cp=2, each rank printing its
peak memory. Packed demo documents, so the flash kernel and the ring both take documents."""

import json
import re
import subprocess
import sys

import pytest

from mindspeed_core.testing import import_sibling

pretrain = import_sibling(__file__, "test_pretrain")
pytestmark = pytest.mark.distributed
QUIET = ["--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
         "--checkpoint.interval=0"]  # fmt: skip
LONG = [
    "--train.steps=3", "--optim.warmup_steps=1", "--train.micro_batch=1",
    "--train.global_batch=1", "--data.split=100,0,0", "--train.eval_interval=0",
]  # fmt: skip


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    }))  # fmt: skip
    return path


def test_8k_under_ring_cp_is_one_process_and_32k_trains(torchrun, env, config, tmp_path):
    args = [*LONG, f"--model.hf_config={config}", "--data.seq_len=8192"]
    one = torchrun(1, tmp_path / "one", *args)
    ring = torchrun(2, tmp_path / "ring", *args, "--parallel.cp=2", "--parallel.cp_mode=ring")
    want = pretrain._losses(one)
    assert sorted(want) == [1, 2, 3]
    pretrain._assert_close(pretrain._losses(ring), want, (1, 2, 3))
    # 32k tokens a sequence, 16k on each of two ranks: the run says what each rank held.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "mindspeed_llm.pretrain", *QUIET, *LONG,
           f"--model.hf_config={config}", "--data.seq_len=32768", "--parallel.cp=2",
           f"--logging.run_dir={tmp_path / 'long'}"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    found = re.search(r"peak memory per rank ([\d.]+), ([\d.]+) GiB", done.stderr)
    assert found, done.stderr[-2000:]
    assert all(0 < float(peak) < 8 for peak in found.groups())
    records = (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in records]
    assert len(losses) == 3 and losses[-1] < losses[0]
