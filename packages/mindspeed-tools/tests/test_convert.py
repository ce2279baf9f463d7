"""`mindspeed convert`: Hugging Face -> MindSpeed -> Hugging Face is bit-identical, the
converted model gives transformers' logits (also under tp=2), and bad input is one line."""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mindspeed_core.checkpoint import steps
from mindspeed_core.checkpoint.verify import read_metadata
from mindspeed_core.cli import run as cli
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.loading import load_model
from mindspeed_llm.models import (
    Transformer,
    TransformerConfig,
    checkpoint_io,
    get_model_spec,
    hf_io,
)
from mindspeed_tools.convert import hf_to_mindspeed, mindspeed_to_hf, parse_size

# Inference forwards of up to 64 tokens run our few-row CPU GEMM (mindspeed_ops.linear): fp32 sums
# in another order than transformers' oneDNN, both fp32-accurate (gemma3: up to 1.8e-5 apart).
LOGITS_ATOL = 2e-5

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")
make_hf, tokens = models_hf.make_hf, models_hf.tokens
CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "sliding_window",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
)


MOE = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    ),
    # latent attention (low-rank q), 8 experts in 4 groups, the first block dense
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "num_key_value_heads": 4,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 32,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "num_nextn_predict_layers": 0,
        },
    ),
    # GLM-4.5: partial rotate-half RoPE (q/k rows permuted), q/k/v biases, qk-norm,
    # grouped sigmoid routing with its balancing bias, a shared expert, the first block dense
    "glm4_moe": ("Glm4MoeConfig", models_hf.GLM4_MOE),
    # MiniMax-M2: q/k norms over all heads, partial RoPE, Mixtral's names plus the bias
    "minimax_m2": (
        "MiniMaxM2Config",
        {"head_dim": 32, "rotary_dim": 16, "intermediate_size": 32, "num_local_experts": 8},
    ),
    # full-rank q (V2-Lite), softmax routing to the best 2 of 4 groups, 2 shared experts
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "num_key_value_heads": 4,
            "n_routed_experts": 8,
            "n_shared_experts": 2,
            "num_experts_per_tok": 3,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.0,
            "moe_intermediate_size": 32,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
        },
    ),
    # attention sinks, q/k/v/o biases, alternating windows, YaRN, biased experts whose
    # gate/up are one interleaved tensor, a clamped SwiGLU (limit low enough to bind)
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 4, "intermediate_size": 32, "head_dim": 16, "sliding_window": 8,
         "swiglu_limit": 0.3},
    ),
    # DeepSeek-V3.2: V3 plus the sparse-attention indexer (wq_b, wk, a LayerNorm, weights_proj)
    "deepseek_v32": (
        "DeepseekV32Config",
        {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4,
         "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
         "v_head_dim": 12, "index_topk": 8, "index_head_dim": 16,
         "index_n_heads": 8},  # zero index scores (ties transformers breaks otherwise) rare
    ),
    # hybrid: gated DeltaNet blocks beside gated attention with partial RoPE (q/k rows
    # permuted), zero-centred norms, a gated shared expert
    "qwen3_next": (
        "Qwen3NextConfig",
        {"num_hidden_layers": 4, "head_dim": 32, "num_experts": 4, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "full_attention_interval": 2,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16},
    ),
    # Qwen3.5-MoE text: the linear blocks' inputs as four projections, regrouped and back
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {"num_hidden_layers": 4, "head_dim": 32, "num_experts": 4, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48,
         "layer_types": ["linear_attention", "full_attention"] * 2,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16},
    ),
}


def _make(case):
    if case not in MOE:
        return make_hf(case)
    cls_name, extra = MOE[case]
    config = getattr(transformers, cls_name)(
        **{**models_hf.TINY, "num_experts_per_tok": 2, **extra}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
        for name, b in model.named_buffers():  # sigmoid routers' balancing bias is saved
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model.eval()


def _hf_dir(tmp_path, case, dtype=torch.float32, shard=None):
    hf = _make(case).to(dtype)
    folder = tmp_path / f"hf-{case}"
    hf.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return hf, folder


def _same_config(a: Path, b: Path):
    ca = transformers.AutoConfig.from_pretrained(a).to_dict()
    cb = transformers.AutoConfig.from_pretrained(b).to_dict()
    for field in CONFIG_FIELDS:
        assert ca.get(field) == cb.get(field), field


@pytest.mark.parametrize(
    ("case", "shard"),
    [
        ("llama", None),
        ("qwen2", "40KB"),
        ("qwen2-tied", None),
        ("qwen3", "40KB"),
        ("mistral-window", None),
        ("mixtral", "40KB"),
        ("qwen2_moe", None),
        ("deepseek_v3", "40KB"),
        ("deepseek_v2", None),  # softmax group-limited routing, no expert bias
        ("phi3", "40KB"),  # fused qkv_proj / gate_up_proj, split and fused again
        ("gemma2", None),  # post norms, tied, soft caps, alternating windows
        ("gemma3", None),  # a second RoPE for the windowed blocks
        ("glm4", "40KB"),
        (
            "internlm3",
            None,
        ),  # Llama's tensors under its own model type  # renamed norms, fused gate_up, q/k rows permuted for partial RoPE
        ("glm", "40KB"),  # GLM-4-9B-chat: glm4's fused gate_up and q/k rows, no post norms
        ("gpt_oss", "40KB"),
        ("deepseek_v32", "40KB"),
        ("glm4_moe", "40KB"),
        ("minimax_m2", None),
        ("qwen3_next", "40KB"),
        ("qwen3_5_moe", "40KB"),
    ],
)
def test_round_trip_is_bit_identical_and_gives_the_same_logits(tmp_path, case, shard):
    hf, src = _hf_dir(tmp_path, case, shard=shard)
    ours = hf_to_mindspeed(src, tmp_path / "ours")
    back = mindspeed_to_hf(ours, tmp_path / "back", max_shard_size=parse_size("50KB"))

    expected = dict(hf_io.iter_hf_tensors(src))  # what save_pretrained wrote
    got = dict(hf_io.iter_hf_tensors(back))
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert (back / "model.safetensors.index.json").is_file()  # 50KB shards
    _same_config(src, back)
    assert (back / "generation_config.json").is_file()

    ids = tokens()
    with torch.no_grad():
        want = hf(ids).logits
        for source in (ours, src):  # the converted checkpoint, and the HF folder itself
            model, _ = load_model(source, dtype=torch.float32)
            torch.testing.assert_close(model(ids), want, atol=LOGITS_ATOL, rtol=0)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            back, attn_implementation="eager"
        )
        torch.testing.assert_close(reloaded(ids).logits, want, atol=0, rtol=0)


def test_bf16_is_kept_and_can_be_changed(tmp_path):
    hf, src = _hf_dir(tmp_path, "llama", dtype=torch.bfloat16)
    ours = hf_to_mindspeed(src, tmp_path / "ours")
    manifest = json.loads((ours / checkpoint_io.MANIFEST_FILE).read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["layout"] == {"tp": 1, "pp": 1, "ep": 1}
    stored = checkpoint_io.tensor_metadata(ours / "step_0")
    assert {d for d, _ in stored.values()} == {torch.bfloat16}
    back = mindspeed_to_hf(ours, tmp_path / "back")
    assert (back / "model.safetensors").is_file()
    for name, tensor in hf_io.iter_hf_tensors(back):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, hf.state_dict()[name])
    assert json.loads((back / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    fp32 = mindspeed_to_hf(ours, tmp_path / "fp32", dtype=torch.float32)
    for name, tensor in hf_io.iter_hf_tensors(fp32):
        assert tensor.dtype == torch.float32 and torch.equal(tensor, hf.state_dict()[name].float())


def _tp2_logits(converted: str, resaved: str):
    """Load the converted checkpoint under tp=2, run it, and save it again (in shards)."""
    from mindspeed_core.checkpoint import CheckpointManager, ModelState
    from mindspeed_core.parallel import ParallelDims
    from mindspeed_llm.models import get_model_spec

    folder = Path(converted)
    config = checkpoint_io.read_checkpoint_config(folder)
    spec = get_model_spec(config.family)
    torch.manual_seed(123)  # other weights than the checkpoint's, so the load must work
    model = spec.parallelize(spec.build(config), ParallelDims(tp=2).build())
    checkpoint_io.load_model_weights(model, steps.resolve(folder))
    CheckpointManager({"model": ModelState(model)}, resaved).save(0, force=True)
    with torch.no_grad():
        return model(tokens())


@pytest.mark.slow
def test_a_converted_checkpoint_loads_under_tp2_and_its_shards_convert_back(tmp_path):
    hf, src = _hf_dir(tmp_path, "qwen2")
    ours = hf_to_mindspeed(src, tmp_path / "ours", tp=2)
    resaved = tmp_path / "resaved"
    with torch.no_grad():
        want = hf(tokens()).logits
    for logits in run_distributed(_tp2_logits, 2, str(ours), str(resaved)):
        torch.testing.assert_close(logits, want, atol=LOGITS_ATOL, rtol=0)
    # The tp=2 save holds the sharded weights in two chunks each: assembled tensor by tensor.
    saved = read_metadata(resaved / "step_0").state_dict_metadata.values()
    assert any(len(getattr(meta, "chunks", ())) == 2 for meta in saved)
    for name in (checkpoint_io.MANIFEST_FILE, "config.json"):
        (resaved / name).write_text((ours / name).read_text())
    back = mindspeed_to_hf(resaved, tmp_path / "back")
    expected = dict(hf_io.iter_hf_tensors(src))
    got = dict(hf_io.iter_hf_tensors(back))
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def _cli(capsys, *args):
    code = cli(["convert", *map(str, args)])
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_no_output(tmp_path, name="out"):
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(name)]


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys):
    _, src = _hf_dir(tmp_path, "llama")
    out = tmp_path / "out"
    cases = []
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append(((empty,), ["empty", "config.json"]))
    cases.append((("some-org/Some-Model",), ["some-org/Some-Model", "local"]))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    cases.append(((gpt2,), ["gpt2", "supported", "llama", "qwen3"]))
    cases.append(((src, "--tp", "4"), ["--tp=4", "num_kv_heads=2"]))
    cases.append(((src, "--pp", "3"), ["--pp=3", "2 layers"]))
    cases.append(((src, "--ep", "2"), ["--ep=2", "no experts"]))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:-64])
    cases.append(((broken,), ["broken/model.safetensors", "truncated"]))
    capsys.readouterr()
    for args, fragments in cases:
        code, err = _cli(
            capsys, "--input", args[0], "--output", out, "--to", "mindspeed", *args[1:]
        )
        assert code == 2, (args, err)
        assert err.startswith("error:") and "\n" not in err, err
        for fragment in fragments:
            assert fragment in err, (fragment, err)
        _assert_no_output(tmp_path)


def test_an_empty_mount_point_is_written_inside_and_a_read_only_folder_is_one_line(
    tmp_path, capsys, monkeypatch
):
    """A container volume: an empty folder that cannot be renamed over or removed (EBUSY)
    under a read-only parent (EROFS): the output is written inside it. A new folder under
    the read-only parent is one line, and nothing is left."""
    import errno
    import os
    import tempfile

    _, src = _hf_dir(tmp_path, "llama")
    root = tmp_path / "root"
    volumes = [root / "volume", root / "volume2"]  # mindspeed, then back to hf
    for volume in volumes:
        volume.mkdir(parents=True)
    real_rename, real_rmdir, real_mkdtemp = os.rename, os.rmdir, tempfile.mkdtemp

    def busy(*paths):  # test doubles of the kernel's answers, not product code
        if set(volumes) & set(map(Path, paths)):
            raise OSError(errno.EBUSY, "Device or resource busy", str(paths[0]))

    def mkdtemp(prefix=None, dir=None, **kwargs):
        if Path(dir) == root:
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real_mkdtemp(prefix=prefix, dir=dir, **kwargs)

    monkeypatch.setattr(os, "rename", lambda a, b: busy(a, b) or real_rename(a, b))
    monkeypatch.setattr(os, "rmdir", lambda p: busy(p) or real_rmdir(p))
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    for source, target, to, marker in ((src, volumes[0], "mindspeed", "latest"),
                                       (volumes[0], volumes[1], "hf", "config.json")):  # fmt: skip
        code, err = _cli(capsys, "--input", source, "--output", target, "--to", to)
        assert code == 0, err
        assert (target / marker).is_file() and not [p for p in target.iterdir() if ".tmp-" in p.name]
    out = root / "new"
    code, err = _cli(capsys, "--input", src, "--output", out, "--to", "mindspeed")
    assert code == 2 and err == f"error: --output {out}: cannot write in {root}: Read-only file system"
    assert sorted(p.name for p in root.iterdir()) == ["volume", "volume2"]


def test_failure_midway_removes_the_partial_output(tmp_path, capsys, monkeypatch):
    _, src = _hf_dir(tmp_path, "llama")
    calls = []

    def failing_read(info, f=None):
        calls.append(info)
        if len(calls) == 3:
            raise hf_io.CheckpointError(f"safetensors file {info.file} is truncated")
        return original(info, f)

    original = hf_io.read_tensor
    monkeypatch.setattr(hf_io, "read_tensor", failing_read)  # a test double, not product code
    capsys.readouterr()
    out = tmp_path / "out" / "nested"  # the folders convert creates go too
    code, err = _cli(capsys, "--input", src, "--output", out, "--to", "mindspeed")
    assert code == 2 and "truncated" in err
    _assert_no_output(tmp_path)


def test_to_hf_refuses_what_is_not_a_checkpoint_and_an_existing_output(tmp_path, capsys):
    _, src = _hf_dir(tmp_path, "llama")
    capsys.readouterr()
    code, err = _cli(capsys, "--input", src, "--output", tmp_path / "out", "--to", "hf")
    assert code == 2 and "not a MindSpeed checkpoint" in err
    ours = tmp_path / "ours"
    assert _cli(capsys, "--input", src, "--output", ours, "--to", "mindspeed")[0] == 0
    code, err = _cli(capsys, "--input", src, "--output", ours, "--to", "mindspeed")
    assert code == 2 and "already exists" in err
    code, err = _cli(
        capsys,
        "--input",
        ours,
        "--output",
        tmp_path / "x",
        "--to",
        "hf",
        "--max-shard-size",
        "lots",
    )
    assert code == 2 and "lots" in err
    shard = max((ours / "step_0").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-5])
    code, err = _cli(capsys, "--input", ours, "--output", tmp_path / "y", "--to", "hf")
    assert code == 2 and "truncated" in err and shard.name in err, err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("x", "y"))]


def test_missing_options_are_one_line(capsys):
    code, err = _cli(capsys, "--input", "x")
    assert code == 2 and "\n" not in err and "--output" in err and "--to" in err


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size("123") == 123


def _variant(tmp_path, src, name, change_tensors=None, change_config=None, change_index=None):
    """A copy of the HF folder `src` with its tensors, config or index changed."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(change_config(config) if change_config else config)
    )
    tensors = load_file(src / "model.safetensors")
    save_file(change_tensors(tensors) if change_tensors else tensors, folder / "model.safetensors")
    if change_index:
        index = {"weight_map": {n: "model.safetensors" for n in tensors}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(change_index(index)))
    return folder


def test_tensors_that_do_not_fit_the_config_are_one_line(tmp_path, capsys):
    _, src = _hf_dir(tmp_path, "llama")
    name = "model.layers.0.mlp.up_proj.weight"

    def wrong_shape(t):
        return {**t, name: torch.zeros(t[name].shape[0], t[name].shape[1] + 1)}

    def integer(t):
        return {**t, name: t[name].to(torch.int32)}

    def outside(index):
        index["weight_map"][name] = "../hf-llama/model.safetensors"
        return index

    shape = tuple(_make("llama").state_dict()[name].shape)
    cases = [
        (
            _variant(tmp_path, src, "shape", change_tensors=wrong_shape),
            [name, f"{shape}", f"({shape[0]}, {shape[1] + 1})"],
        ),
        (
            _variant(tmp_path, src, "int", change_tensors=integer),
            [name, "torch.int32", "floating-point"],
        ),
        (
            _variant(
                tmp_path,
                src,
                "cfg",
                change_config=lambda c: {k: v for k, v in c.items() if k != "hidden_size"},
            ),
            ["config.json", "'hidden_size'"],
        ),
        (
            _variant(tmp_path, src, "index", change_index=outside),
            ["../hf-llama/model.safetensors", "outside the model folder"],
        ),
    ]
    capsys.readouterr()
    for folder, fragments in cases:
        code, err = _cli(
            capsys, "--input", folder, "--output", tmp_path / "out", "--to", "mindspeed"
        )
        assert code == 2 and err.startswith("error:") and "\n" not in err, err
        for fragment in fragments:
            assert fragment in err, (fragment, err)
        assert not (tmp_path / "out").exists()


def test_a_corrupt_record_header_is_one_line_naming_the_shard(tmp_path, capsys):
    _, src = _hf_dir(tmp_path, "llama")
    ours = tmp_path / "ours"
    assert _cli(capsys, "--input", src, "--output", ours, "--to", "mindspeed")[0] == 0
    shard = max((ours / "step_0").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[:16] = b"\xff" * 16  # the record's zip header
    shard.write_bytes(bytes(data))
    for checksums in (True, False):  # recorded checksums, and a checkpoint without them
        if not checksums:
            (ours / "step_0" / "checksums.json").unlink()
        code, err = _cli(capsys, "--input", ours, "--output", tmp_path / "back", "--to", "hf")
        assert code == 2 and "\n" not in err and f"shard {shard}" in err and "corrupt" in err, err
        assert not (tmp_path / "back").exists()


def test_a_full_disk_is_one_line_and_a_killed_converts_temporaries_go(
    tmp_path, capsys, monkeypatch
):
    import errno
    import os
    import subprocess

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from mindspeed_core.checkpoint.safetensors import SafetensorsWriter
    from mindspeed_core.files import owned_temp_prefix

    _, src = _hf_dir(tmp_path, "llama")
    ours = tmp_path / "ours"
    assert _cli(capsys, "--input", src, "--output", ours, "--to", "mindspeed")[0] == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / owned_temp_prefix("back").replace(f".{os.getpid()}.", f".{dead.pid}.")
    (stale.parent / (stale.name + "x")).mkdir()  # what a SIGKILLed convert leaves

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(dcp_fs, "_write_item", no_space)
        code, err = _cli(capsys, "--input", src, "--output", tmp_path / "full", "--to", "mindspeed")
    assert code == 2 and "\n" not in err and err.startswith("error: no space left on device for ")
    assert re.search(rf"{tmp_path / 'full'} \(needed ~\d+ MB, \d+ MB free\)", err), err
    with monkeypatch.context() as patch:
        patch.setattr(SafetensorsWriter, "write", no_space)
        code, err = _cli(capsys, "--input", ours, "--output", tmp_path / "back", "--to", "hf")
    assert code == 2 and "no space left on device" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-llama", "ours"]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_convert_and_come_back(tmp_path, family):
    """DeepSeek's and GLM-4.5's published layout puts MTP module k at
    model.layers.{num_hidden_layers + k} (transformers drops it); both conversions keep it,
    bit-identical, and it loads."""
    _, src = _hf_dir(tmp_path, family, shard="40KB")
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(hf_config))
    config = TransformerConfig.from_hf(hf_config)
    main = dict(hf_io.iter_hf_tensors(src))
    torch.manual_seed(1)
    drawn = get_model_spec(family).hf_adapter.to_hf(Transformer(config).state_dict(), config)
    mtp = {k: v for k, v in drawn.items() if k.startswith("model.layers.3.")}
    mtp["model.layers.3.embed_tokens.weight"] = main["model.embed_tokens.weight"]
    mtp["model.layers.3.shared_head.head.weight"] = main["lm_head.weight"]
    save_file(mtp, src / "model-mtp.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    ours = hf_to_mindspeed(src, tmp_path / "ours")
    back = mindspeed_to_hf(ours, tmp_path / "back", max_shard_size=parse_size("50KB"))
    expected, got = dict(hf_io.iter_hf_tensors(src)), dict(hf_io.iter_hf_tensors(back))
    assert got.keys() == expected.keys() and "model.layers.3.eh_proj.weight" in got
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    model, _ = load_model(ours, dtype=torch.float32)
    assert torch.equal(model.mtp.layers["3"].eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])


def test_internlm2_round_trip_is_bit_identical_and_gives_llamas_logits(tmp_path):
    """InternLM2 has no transformers class: a folder written by hand in its published
    layout (fused grouped wqkv, top-level output.weight) converts and comes back
    bit-identical, and the converted model gives the logits of transformers' Llama holding
    the same weights unfused (models_hf.llama_oracle)."""
    src = tmp_path / "hf-internlm2"
    src.mkdir()
    weights = models_hf.internlm2_state_dict(models_hf.INTERNLM2)
    save_file(weights, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(models_hf.INTERNLM2))
    ours = hf_to_mindspeed(src, tmp_path / "ours")
    back = mindspeed_to_hf(ours, tmp_path / "back", max_shard_size=parse_size("50KB"))
    got = dict(hf_io.iter_hf_tensors(back))
    assert got.keys() == weights.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, weights[name]), name
    written = json.loads((back / "config.json").read_text())
    assert written["model_type"] == "internlm2" and written["bias"] is False
    assert TransformerConfig.from_hf(written) == TransformerConfig.from_hf(models_hf.INTERNLM2)
    ids = tokens()
    with torch.no_grad():
        want = models_hf.llama_oracle(models_hf.INTERNLM2, weights)(ids).logits
        for source in (ours, src):
            model, _ = load_model(source, dtype=torch.float32)
            torch.testing.assert_close(model(ids), want, atol=LOGITS_ATOL, rtol=0)
