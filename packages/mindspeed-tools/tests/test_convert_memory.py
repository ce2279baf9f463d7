"""`mindspeed convert` holds about one tensor, never the model: Megatron checkpoints (legacy
rank files merged over tp and pp; torch_dist's layer-stacked tensors) and a LoRA run's
merge into Hugging Face weights are converted in a child process whose peak resident
memory above its start stays within a small multiple of the largest tensor, far below the
model's size; the outputs are the bit-exact ones (the source itself after HF -> Megatron
-> HF; `load_model`'s merge)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from mindspeed_core.checkpoint.safetensors import SafetensorsWriter, read_tensor
from mindspeed_core.cli import run as cli
from mindspeed_llm.models import Transformer, TransformerConfig
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.hf_io import hf_tensor_index, iter_hf_tensors, read_hf_config
from mindspeed_tools.convert import megatron
from mindspeed_tools.convert.megatron import legacy

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


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> tuple[Path, int, int]:
    """(the random Hugging Face folder, its bytes, its largest tensor's bytes)."""
    folder = tmp_path_factory.mktemp("memory") / "hf"
    return (folder, *write_random_hf(folder))


def _report(what: str, peak: int, start: float, model_bytes: int, largest: int) -> None:
    mib = 2**20
    print(f"{what}: {peak / mib:.0f} MiB above start in {time.perf_counter() - start:.1f} s; "
          f"model {model_bytes / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB")  # fmt: skip


@pytest.mark.slow
def test_megatron_legacy_tp2_pp2_converts_with_about_one_tensor_in_memory(random_model, tmp_path):
    hf, model_bytes, largest = random_model
    mega, back = tmp_path / "megatron", tmp_path / "back"
    assert cli(["convert", "--input", str(hf), "--output", str(mega), "--to", "megatron",
                "--tp", "2", "--pp", "2"]) == 0  # fmt: skip
    start = time.perf_counter()
    peak = peak_above_start("convert", "--input", mega, "--output", back, "--to", "hf")
    _report("megatron legacy -> hf", peak, start, model_bytes, largest)
    # one tensor's two tp shards and their merge (the whole model: 8x the largest tensor)
    assert peak < 2.5 * largest, (peak, largest)
    assert_same_tensors(hf, back)


def test_megatron_rank_files_are_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The cheap guard of the above: opening a legacy checkpoint reads no tensor, and each
    tensor's shards are read only when that tensor is asked for."""
    small = dict(CONFIG, vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)
    hf, mega = tmp_path / "hf", tmp_path / "megatron"
    write_random_hf(hf, small)
    assert cli(["convert", "--input", str(hf), "--output", str(mega), "--to", "megatron",
                "--tp", "2", "--pp", "2"]) == 0  # fmt: skip
    reads = []
    read = legacy._RankFile.read
    monkeypatch.setattr(legacy._RankFile, "read", lambda *a: reads.append(a[2]) or read(*a))
    tensors = megatron.read_checkpoint(mega)
    assert reads == [] and all(t.is_meta for t in tensors.meta.values())
    for i, (name, tensor) in enumerate(tensors.items()):
        assert reads == [name] * len(reads) and len(reads) in (1, 2), (i, name, reads)
        assert tuple(tensor.shape) == tuple(tensors.meta[name].shape)
        reads.clear()
    assert i + 1 == len(tensors.meta)


class _OneChunkPerLayer(dcp.DefaultSavePlanner):
    """Saves each layer of a layer-stacked tensor as its own chunk, as Megatron's
    dist_checkpointing does (every layer is a ShardedTensor at its layer's offset)."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            shape = self.state_dict[item.index.fqn].shape
            if not item.index.fqn.startswith("decoder.layers."):
                items.append(item)
                continue
            for i in range(shape[0]):
                at = torch.Size((i, *(0,) * (len(shape) - 1)))
                chunk = ChunkStorageMetadata(offsets=at, sizes=torch.Size((1, *shape[1:])))
                data = dataclasses.replace(item.tensor_data, chunk=chunk)
                index = MetadataIndex(item.index.fqn, at)
                items.append(dataclasses.replace(item, index=index, type=WriteItemType.SHARD,
                                                 tensor_data=data))  # fmt: skip
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        tensor = self.state_dict[write_item.index.fqn]
        chunk = write_item.tensor_data.chunk
        for dim, (at, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            tensor = tensor.narrow(dim, at, size)
        return tensor.contiguous()


def write_torch_dist(hf: Path, root: Path) -> None:
    """The Hugging Face model as a Megatron torch_dist save: Megatron's names, homogeneous
    layers stacked along a leading axis (one chunk per layer), `common.pt` holding the args."""
    config = read_hf_config(hf)
    whole = megatron.to_megatron(dict(iter_hf_tensors(hf)), config)
    layers: dict[str, list[torch.Tensor]] = {}
    tensors = {}
    for name, tensor in whole.items():
        match = re.match(r"^decoder\.layers\.\d+\.(.+)$", name)
        if match:
            layers.setdefault(f"decoder.layers.{match.group(1)}", []).append(tensor)
        else:
            tensors[name] = tensor
    tensors.update({name: torch.stack(parts) for name, parts in layers.items()})
    folder = root / "iter_0000001"
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)),
             planner=_OneChunkPerLayer(), no_dist=True)  # fmt: skip
    args = megatron.megatron_args(config, 1, 1, torch.float32)
    args.ckpt_format = "torch_dist"
    torch.save({"args": args, "iteration": 1}, folder / megatron.COMMON_FILE)
    (root / megatron.LATEST_FILE).write_text("1\n")


@pytest.mark.slow
def test_megatron_torch_dist_converts_one_layer_slice_at_a_time(random_model, tmp_path):
    hf, model_bytes, largest = random_model
    mega, back = tmp_path / "megatron", tmp_path / "back"
    write_torch_dist(hf, mega)
    start = time.perf_counter()
    peak = peak_above_start("convert", "--input", mega, "--output", back, "--to", "hf")
    _report("megatron torch_dist -> hf", peak, start, model_bytes, largest)
    # a region's buffer and the record DCP reads it from (the whole model: 8x)
    assert peak < 2.5 * largest, (peak, largest)
    assert_same_tensors(hf, back)


@pytest.mark.slow
def test_merge_lora_holds_about_one_tensor_and_gives_load_models_merge(
    random_model, tmp_path, monkeypatch
):
    """A LoRA run (every linear, rank 4) on the random model: `--merge-lora` writes
    `load_model`'s merged weights bit for bit, about one tensor in memory; the run's own
    `logging.hf_export_every` export (the same writer, in the trainer's process) is the
    same file."""
    from mindspeed_core.config import load_config
    from mindspeed_core.distributed import destroy_distributed, init_distributed
    from mindspeed_core.testing import import_sibling
    from mindspeed_llm.loading import load_model
    from mindspeed_llm.models.registry import get_model_spec
    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.train.trainer import Trainer

    lora_tests = import_sibling(__file__, "test_convert_lora")
    base, model_bytes, largest = random_model
    run, out = tmp_path / "run", tmp_path / "merged"
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    args = ["--train.steps=1", "--train.micro_batch=1", "--train.global_batch=1",
            "--data.seq_len=16", "--optim.warmup_steps=0", "--optim.lr=1e-2",
            "--train.eval_interval=0", "--logging.progress=false", "--logging.tensorboard=false",
            f"--model.hf_path={base}", f"--logging.run_dir={run}", "--lora.rank=4",
            "--checkpoint.interval=1", "--logging.hf_export_every=1"]  # fmt: skip
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
    _report("merge lora -> hf", peak, start, model_bytes, largest)
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
    exported = (run / "hf" / "step_1" / "model.safetensors").read_bytes()
    assert exported == (out / "model.safetensors").read_bytes()
