"""Models larger than a process can hold whole start on this 24 GiB machine (S2).

A random Llama of about 2B parameters (a transformers config, bf16 safetensors written one
tensor at a time, nothing downloaded): `generate --tp 4` under torchrun prints one
process's greedy tokens, and a LoRA fine-tune under `--parallel.dp_shard 4` gives one
process's losses, each rank's start-up peak under its quarter of the fp32 model plus the
largest tensor plus 1.5 GiB. And the Llama-3.2-1B shape pretrains under dp_shard=2 with a
start-up peak under half its fp32 model plus the largest tensor plus 1.5 GiB.

Before S2 every rank built the whole fp32 model and read every weight: these runs were
killed for memory. Slow: several GB of weights on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_core.checkpoint.safetensors import SafetensorsWriter
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.data.sft_templates import TEMPLATES
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_io import to_hf_plan
from mindspeed_llm.models.startup import base_shapes, build_meta

pytestmark = pytest.mark.slow

LLM_TESTS = Path(__file__).resolve().parents[1] / "packages" / "mindspeed-llm" / "tests"
chat_tests = import_sibling(str(LLM_TESTS / "conftest.py"), "test_chat_template")
GiB = 2**30
BIG = {  # 1.96B parameters: 30 layers of width 2048, Llama-2's vocabulary (four ranks of
    # FSDP training with Llama-3's would each gather its 2 GiB fp32 embedding and head:
    # more than this machine has beside the one-process reference)
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_32_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}  # fmt: skip


def _sizes(hf: dict) -> tuple[int, int]:
    """(fp32 bytes of the whole model, fp32 bytes of its largest tensor)."""
    shapes = base_shapes(build_meta(TransformerConfig.from_hf(hf)))
    if hf["tie_word_embeddings"]:
        shapes.pop("output.weight")
    numels = [math.prod(s) for s in shapes.values()]
    return 4 * sum(numels), 4 * max(numels)


def _write_model(folder: Path, hf: dict) -> Path:
    """config.json, a chat tokenizer and random bf16 weights in 3 shards, one tensor at a
    time (N(0, 0.02), norms 1), as `save_pretrained` lays them out."""
    chat_tests.make_folder(folder, TEMPLATES["chatml"])
    (folder / "config.json").write_text(json.dumps(hf))
    config = TransformerConfig.from_hf(hf)
    ours = {n: torch.empty(s, device="meta") for n, s in base_shapes(build_meta(config)).items()}
    shapes, _ = to_hf_plan(config, ours)
    names = sorted(shapes)
    files = [f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)]
    where = {name: files[i * 3 // len(names)] for i, name in enumerate(names)}
    gen = torch.Generator().manual_seed(0)
    for file in files:
        entries = [(n, torch.bfloat16, shapes[n][1]) for n in names if where[n] == file]
        writer = SafetensorsWriter(folder / file, entries)
        for name, _, shape in entries:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape)
            else:
                tensor = torch.randn(shape, generator=gen) * 0.02
            writer.write(name, tensor.to(torch.bfloat16))
        writer.close()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": where})
    )
    return folder


def _peak_rss(cmd: list[str], env: dict, timeout: int) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd`; (its result, the largest peak resident set of it or any process it
    waited for, in bytes: every torchrun rank)."""
    wrapper = (
        "import resource, subprocess, sys, json\n"
        "done = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True)\n"
        "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr)\n"
        "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(done.returncode)\n"
    )
    done = subprocess.run([sys.executable, "-c", wrapper, json.dumps(cmd)], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    peak = int(re.search(r"MAXRSS (\d+)", done.stderr).group(1)) * 1024
    return done, peak


def _startup_peaks(log: str) -> list[float]:
    match = re.search(r"start-up peak per rank ([\d., ]+) GiB", log)
    assert match, log[-3000:]
    return [float(x) for x in match.group(1).split(",")]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("big") / "llama-2b", BIG)


def test_generate_tp4_prints_one_process_greedy_tokens_within_its_share(big, env):
    whole, largest = _sizes(BIG)
    args = ["generate", "--model", str(big), "--dtype", "fp32", "--max-new-tokens", "6",
            "--seed", "0", "alice had a little"]  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "mindspeed_core.cli", *args], env=env,
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=4", "-m", "mindspeed_core.cli", *args, "--tp", "4"]  # fmt: skip
    tp4, peak = _peak_rss(torchrun, env, timeout=1800)
    assert tp4.returncode == 0, tp4.stderr[-3000:]
    assert tp4.stdout.strip() == one.stdout.strip() and one.stdout.strip()
    bound = whole / 4 + largest + 1.5 * GiB
    print(f"generate --tp 4: peak per rank {peak / GiB:.2f} GiB (bound {bound / GiB:.2f})")
    assert peak < bound


def _sft(folder: Path, data: Path, run: Path, nproc: int, env: dict) -> subprocess.CompletedProcess:
    args = [f"--model.hf_path={folder}", f"--data.paths=[{data}]", "--data.seq_len=32",
            "--data.valid_fraction=0", f"--data.cache_dir={run}/cache", "--train.steps=3",
            "--train.micro_batch=1", "--train.global_batch=4", "--optim.warmup_steps=1",
            "--lora.rank=8", "--train.eval_interval=0", "--checkpoint.interval=0",
            "--logging.log_interval=1", "--logging.progress=false",
            "--logging.tensorboard=false", f"--logging.run_dir={run}"]  # fmt: skip
    if nproc > 1:
        args.append(f"--parallel.dp_shard={nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "mindspeed_core.cli", "sft", *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)


def test_lora_sft_dp_shard4_gives_one_process_losses_within_its_share(big, env, tmp_path):
    whole, largest = _sizes(BIG)
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                          {"role": "assistant", "content": f"it is {2 * i}"}]} for i in range(16)]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = _sft(big, data, tmp_path / "one", 1, env)
    assert one.returncode == 0, one.stderr[-3000:]
    four = _sft(big, data, tmp_path / "four", 4, env)
    assert four.returncode == 0, four.stderr[-3000:]
    losses = [[r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r]
              for run in ("one", "four")]  # fmt: skip
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    peaks = _startup_peaks(four.stderr + four.stdout)
    bound = (whole / 4 + largest + 1.5 * GiB) / GiB
    print(f"sft dp_shard=4: start-up peak per rank {peaks} GiB (bound {bound:.2f})")
    assert len(peaks) == 4 and max(peaks) < bound


_START_ONLY = """
import sys
from mindspeed_core.config import load_config
from mindspeed_core.distributed import process_group, setup_logging
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.trainer import Trainer

cfg = load_config(PretrainConfig, None, sys.argv[1:])
with process_group("cpu") as info:
    setup_logging()
    peaks = Trainer(cfg, info).startup_peak_gb  # the model built and loaded; no step
    if info.rank == 0:
        print("start-up peak per rank", ", ".join(f"{p:.2f}" for p in peaks), "GiB")
"""


def test_the_llama_3_2_1b_shape_starts_under_dp_shard2(tmp_path, env):
    """Started only: a training step of the 1.24B model (AdamW's states and the gradients:
    about 20 GB over both ranks) does not fit this machine beside the test's other work."""
    whole, largest = _sizes(LLAMA_32_1B)
    config = tmp_path / "llama-3.2-1b.json"
    config.write_text(json.dumps(LLAMA_32_1B))
    script = tmp_path / "start.py"
    script.write_text(_START_ONLY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), f"--model.hf_config={config}", "--parallel.dp_shard=2",
           "--data.seq_len=64", "--train.micro_batch=1", "--train.global_batch=2",
           "--logging.progress=false", "--logging.tensorboard=false",
           f"--logging.run_dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = _startup_peaks(done.stderr + done.stdout)
    bound = (whole / 2 + largest + 1.5 * GiB) / GiB
    print(f"Llama-3.2-1B dp_shard=2: start-up peak per rank {peaks} GiB (bound {bound:.2f})")
    assert len(peaks) == 2 and max(peaks) < bound
