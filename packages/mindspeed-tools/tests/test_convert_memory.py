"""`mindspeed convert` holds about one tensor, never the model: a Megatron checkpoint (legacy
rank files merged over tp and pp) and a LoRA run's merge into Hugging Face weights are
converted in a child process whose peak resident memory above its start stays within a
small multiple of the largest tensor, far below the model's size; the outputs are the
bit-exact ones (the source itself after HF -> Megatron -> HF; `load_model`'s merge)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mindspeed_core.checkpoint.safetensors import SafetensorsWriter, read_tensor
from mindspeed_core.cli import run as cli
from mindspeed_llm.models import Transformer, TransformerConfig
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.hf_io import hf_tensor_index

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")

# fp32, untied: 64M parameters (254 MiB); the largest tensors, embedding and output layer,
# are 32 MiB each: the model is 8x its largest tensor
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_CHILD = """
import json, sys
from mindspeed_core.cli import run
import mindspeed_tools.convert  # every import before the baseline


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


before = status("VmRSS:")
code = run(sys.argv[1:])
print(json.dumps({"code": code, "before": before, "peak": status("VmHWM:")}))
"""


def write_random_hf(folder: Path, config: dict = CONFIG) -> tuple[int, int]:
    """A random Hugging Face folder of `config`, written one tensor at a time;
    returns (model bytes, largest tensor bytes)."""
    folder.mkdir(parents=True)
    with torch.device("meta"):
        ours = Transformer(TransformerConfig.from_hf(config)).state_dict()
    meta = hf_adapter.to_hf(ours, TransformerConfig.from_hf(config))
    entries = [(name, torch.float32, tuple(t.shape)) for name, t in meta.items()]
    writer = SafetensorsWriter(folder / "model.safetensors", entries)
    gen = torch.Generator().manual_seed(0)
    for name, dtype, shape in entries:
        writer.write(name, torch.empty(shape, dtype=dtype).normal_(0, 0.02, generator=gen))
    writer.close()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in entries]
    return sum(sizes), max(sizes)


def peak_above_start(*argv) -> int:
    """Bytes of resident memory `mindspeed ARGV` reached above its process's start (imports
    done), run in a child process. glibc's malloc is told to give every block of 64 KiB
    or more back when it is freed (by default it may keep up to ~64 MiB of freed blocks
    for reuse, a constant that would blur the measure): the peak is then that of the
    tensors alive at once."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, argv)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr[-3000:]
    return result["peak"] - result["before"]


def assert_same_tensors(a: Path, b: Path) -> None:
    left, right = hf_tensor_index(a), hf_tensor_index(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(read_tensor(left[name]), read_tensor(right[name])), name


def test_megatron_legacy_tp2_pp2_converts_with_about_one_tensor_in_memory(tmp_path):
    hf, mega, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    model_bytes, largest = write_random_hf(hf)
    assert cli(["convert", "--input", str(hf), "--output", str(mega), "--to", "megatron",
                "--tp", "2", "--pp", "2"]) == 0  # fmt: skip
    start = time.perf_counter()
    peak = peak_above_start("convert", "--input", mega, "--output", back, "--to", "hf")
    print(f"megatron -> hf: {peak / 2**20:.0f} MiB above start in {time.perf_counter() - start:.1f} s; "
          f"model {model_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB")  # fmt: skip
    # one tensor's two tp shards and their merge (the whole model: 8x the largest tensor)
    assert peak < 2.5 * largest, (peak, largest)
    assert_same_tensors(hf, back)


@pytest.mark.slow
def test_merge_lora_holds_about_one_tensor_and_gives_load_models_merge(tmp_path, monkeypatch):
    """A LoRA run (every linear, rank 4) on the random model: `--merge-lora` writes
    `load_model`'s merged weights bit for bit, about one tensor in memory."""
    from mindspeed_core.config import load_config
    from mindspeed_core.distributed import destroy_distributed, init_distributed
    from mindspeed_core.testing import import_sibling
    from mindspeed_llm.loading import load_model
    from mindspeed_llm.models.registry import get_model_spec
    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.train.trainer import Trainer

    lora_tests = import_sibling(__file__, "test_convert_lora")
    base, run, out = tmp_path / "base", tmp_path / "run", tmp_path / "merged"
    model_bytes, largest = write_random_hf(base)
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    args = ["--train.steps=1", "--train.micro_batch=1", "--train.global_batch=1",
            "--data.seq_len=16", "--optim.warmup_steps=0", "--optim.lr=1e-2",
            "--train.eval_interval=0", "--logging.progress=false", "--logging.tensorboard=false",
            f"--model.hf_path={base}", f"--logging.run_dir={run}", "--lora.rank=4"]  # fmt: skip
    cfg = load_config(lora_tests.LoRAPretrainConfig, None, args)
    trainer = Trainer(cfg, init_distributed(device_type="cpu"), **lora_trainer_options(cfg.lora))
    try:
        trainer.run()
    finally:
        destroy_distributed()
    del trainer
    start = time.perf_counter()
    peak = peak_above_start("convert", "--input", run / "checkpoints", "--output", out,
                            "--to", "hf", "--merge-lora")  # fmt: skip
    print(f"merge lora -> hf: {peak / 2**20:.0f} MiB above start in {time.perf_counter() - start:.1f} s; "
          f"model {model_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB")  # fmt: skip
    # the embedding alone, or an adapted weight, its merged copy and the fp32 update
    assert peak < 2.5 * largest, (peak, largest)
    model, config = load_model(run / "checkpoints")
    want = get_model_spec(config.family).hf_adapter.to_hf(model.state_dict(), config)
    got = hf_tensor_index(out)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(read_tensor(got[name]), tensor), name
    merged = read_tensor(got["model.layers.0.mlp.down_proj.weight"])
    source = read_tensor(hf_tensor_index(base)["model.layers.0.mlp.down_proj.weight"])
    assert not torch.equal(merged, source)  # the adapters trained: merging changed the weight
