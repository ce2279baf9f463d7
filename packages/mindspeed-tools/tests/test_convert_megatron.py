"""`mindspeed convert --from megatron`: a Megatron-Core GPTModel (local spec, CPU, gloo)
saved under tp/pp in the legacy per-rank format and with dist_checkpointing (torch_dist)
converts to a Hugging Face folder whose transformers logits are Megatron-Core's own, and
to a MindSpeed checkpoint that loads; a hostile pickle is refused without writing. And back:
`--to megatron` writes per-rank files Megatron-Core's GPTModel loads strictly, with
transformers' logits, and HF -> Megatron -> HF is bit-identical.

Megatron-Core 0.16 runs on CPU with three concessions, all inside the spawned ranks:
its inference RNG tracker (`initialize_rng_tracker(inference_rng_tracker=True)`, whose
fork is a no-op), an explicit causal mask (its default one is made on "cuda"), and
`torch.cuda.current_device` / `torch.cuda.synchronize` mocked while it runs (its RoPE
moves `inv_freq` to the current CUDA device; its DCP save synchronises CUDA). Its MoE
layer needs two more: the allgather token dispatcher (the alltoall one makes a CUDA
stream) and `moe_utils.te_general_gemm` defined as None (0.16 reads the name without
Transformer Engine installed).
"""

import argparse
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers

from mindspeed_core.cli import run as cli
from mindspeed_core.testing import run_distributed
from mindspeed_core.testing.hostile import plant_hostile_torch_file
from mindspeed_llm.loading import load_model
from mindspeed_tools.convert.megatron import split_qkv

pytest.importorskip("megatron.core")

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ = 128, 64, 4, 2, 96, 4, 16
ITERATION = 10
ATOL = 1e-4


def _megatron_args(tp: int, pp: int, ep: int = 1, moe: str | None = None) -> argparse.Namespace:
    """The args Megatron-LM's training saves, under its argument names (the fields the
    converter reads, and a few it ignores)."""
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=HIDDEN // HEADS,
        max_position_embeddings=64,
        seq_length=SEQ,
        padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        ckpt_format="torch",
        **(_moe_args(moe) if moe else {}),
    )


# MoE: 4 experts of width 32, top-2, every layer; Qwen3-MoE has qk-norm, Mixtral not
EXPERTS, TOPK, EXPERT_FFN = 4, 2, 32


def _moe_args(moe: str) -> dict:
    return {
        "num_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_ffn_hidden_size": EXPERT_FFN,
        "moe_router_load_balancing_type": "none",
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "qk_layernorm": moe == "qwen3_moe",
        "moe_router_pre_softmax": False,
        "moe_layer_freq": 1,
    }


def _build_save_forward(
    out: str,
    tp: int,
    pp: int,
    torch_dist: bool,
    load: str | None = None,
    ep: int = 1,
    moe: str | None = None,
):
    """One rank: build the model (or load its rank file from the legacy checkpoint `load`,
    strictly), run it on fixed tokens, save it; the last stage returns the logits
    (gathered over tp), the others None. `moe` ("mixtral" / "qwen3_moe") makes every
    layer's MLP `EXPERTS` experts spread over `ep` expert-parallel ranks."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)
    config = _megatron_config(tp, pp, ep, moe)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = _gpt(config, moe, first, last)
    _perturb(model, ep)
    if load is not None:
        rank = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        rank += f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else ""
        file = Path(load) / "iter_0000001" / rank / "model_optim_rng.pt"
        model.load_state_dict(torch.load(file, weights_only=True)["model"], strict=True)
    tokens = _tokens()
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    logits = None
    cuda_on_cpu = (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
        mock.patch.object(moe_utils, "te_general_gemm", None, create=True),
    )
    with torch.no_grad(), cuda_on_cpu[0], cuda_on_cpu[1], cuda_on_cpu[2]:
        if not first:
            hidden = torch.empty(SEQ, 2, HIDDEN)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        result = model(tokens, positions, causal)
        if not last:
            dist.send(result.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(result) for _ in range(tp)]
            group = ps.get_tensor_model_parallel_group()
            dist.all_gather(parts, result.contiguous(), group=group)
            logits = torch.cat(parts, dim=-1)
        if load is None:
            _save(model, Path(out), tp, pp, torch_dist, ep, moe)
    return logits


def _build_save_forward_vpp(out: str):
    """One rank of pp=2 with two virtual-pipeline chunks of one layer each: layers 0 and 2
    on stage 0, 1 and 3 on stage 1, run in Megatron's chunk order (chunk 0 on stage 0,
    then 1, then chunk 1 on each); saved as Megatron-LM saves several chunks (`model0`,
    `model1` in each legacy rank file; both under torch_dist). The last stage returns
    the logits."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    pp, chunks = 2, 2
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=chunks
    )
    initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)
    config = _megatron_config(1, pp, vpp=chunks)
    models = []
    for chunk in range(chunks):
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk)
        models.append(_gpt(config, None, first, last, vp_stage=chunk))
        _perturb(models[-1], salt=f"chunk{chunk}")
    tokens, positions = _tokens(), torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    stage, logits = ps.get_pipeline_model_parallel_rank(), None
    with (
        torch.no_grad(),
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
    ):
        for chunk, model in enumerate(models):
            if (chunk, stage) != (0, 0):
                hidden = torch.empty(SEQ, 2, HIDDEN)
                dist.recv(hidden, (stage - 1) % pp)
                model.set_input_tensor(hidden)
            result = model(tokens, positions, causal)
            if (chunk, stage) != (chunks - 1, pp - 1):
                dist.send(result.contiguous(), (stage + 1) % pp)
            else:
                logits = result
        args = _megatron_args(1, pp)
        args.virtual_pipeline_model_parallel_size = chunks
        args.num_layers_per_virtual_pipeline_stage = LAYERS // pp // chunks
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
        rank_dir = Path(out) / "legacy" / f"iter_{ITERATION:07d}" / f"mp_rank_00_{stage:03d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        saved = {f"model{c}": m.state_dict_for_save_checkpoint() for c, m in enumerate(models)}
        torch.save({**state, **saved}, rank_dir / "model_optim_rng.pt")
        args.ckpt_format = "torch_dist"
        folder = Path(out) / "torch_dist" / f"iter_{ITERATION:07d}"
        folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        sharded = {f"model{c}": m.sharded_state_dict() for c, m in enumerate(models)}
        dist_checkpointing.save({**state, **sharded}, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        for root in ("legacy", "torch_dist"):
            (Path(out) / root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    return logits


def _megatron_config(tp: int, pp: int, ep: int = 1, moe: str | None = None, vpp=None):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        init_method_std=0.05,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **(_moe_config(moe, ep) if moe else {}),
    )


def _gpt(config, moe: str | None, first: bool, last: bool, vp_stage: int | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm",
            num_experts=EXPERTS if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=moe == "qwen3_moe",
        ),
        vocab_size=VOCAB,
        max_sequence_length=64,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
        vp_stage=vp_stage,
    ).eval()


def _perturb(model, ep: int = 1, salt: str = "") -> None:
    """Megatron-Core's init gives every tp rank the same norm weights; make them differ
    from 1 so a wrong mapping of norms shows in the logits. Each expert gets its own
    weights wherever it lives (so a wrong expert index shows); the router is the same
    on every rank."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=_gen(name + salt)))
            if "router" in name:
                param.copy_(torch.randn(param.shape, generator=_gen(name)))
            if "local_experts" in name:
                local = int(name.split("local_experts.")[1].split(".")[0])
                index = ps.get_expert_model_parallel_rank() * (EXPERTS // ep) + local
                key = f"{name}{index}{ps.get_tensor_model_parallel_rank()}"
                param.add_(0.05 * torch.randn(param.shape, generator=_gen(key)))


def _moe_config(moe: str, ep: int) -> dict:
    return {
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_ffn_hidden_size": EXPERT_FFN,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_load_balancing_type": "none",
        "expert_model_parallel_size": ep,
        "qk_layernorm": moe == "qwen3_moe",
    }


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, name)))


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _save(
    model, out: Path, tp: int, pp: int, torch_dist: bool, ep: int = 1, moe: str | None = None
) -> None:
    """Megatron-LM's two save layouts (megatron/training/checkpointing.py, core_r0.16:
    `get_checkpoint_name` names `iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`
    and `save_checkpoint` torch.saves {"args", "checkpoint_version", "iteration", "model":
    state_dict_for_save_checkpoint()} there; with --ckpt-format torch_dist it calls
    `dist_checkpointing.save` on the same dict holding `model.sharded_state_dict()`)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    legacy, sharded = out / "legacy", out / "torch_dist"
    args = _megatron_args(tp, pp, ep, moe)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    rank_dir += f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
    iteration = legacy / f"iter_{ITERATION:07d}" / rank_dir
    iteration.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    model_state = model.state_dict_for_save_checkpoint()
    torch.save({**state, "model": model_state}, iteration / "model_optim_rng.pt")
    if torch_dist:
        args.ckpt_format = "torch_dist"
        folder = sharded / f"iter_{ITERATION:07d}"
        folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({**state, "model": model.sharded_state_dict()}, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        for root in (legacy, sharded) if torch_dist else (legacy,):
            (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")


def _megatron_run(
    tmp_path: Path, tp: int, pp: int, torch_dist: bool, load=None, ep: int = 1, moe=None
) -> torch.Tensor:
    """Megatron's logits (every data-parallel copy's the same); under ep the world is
    tp x pp x ep (expert parallelism is carved from data parallelism)."""
    results = run_distributed(
        _build_save_forward,
        tp * pp * ep,
        str(tmp_path),
        tp,
        pp,
        torch_dist,
        load,
        ep,
        moe,
        timeout=300,
    )
    logits = [r for r in results if r is not None]
    # the data-parallel copies sum their tokens' experts in rank order: ulp-level apart
    torch.testing.assert_close(logits[0], logits[-1], atol=0 if ep == 1 else 1e-5, rtol=0)
    return logits[0]


def _hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(_tokens()).logits


def _cli(capsys, *args) -> tuple[int, str]:
    code = cli(["convert", *map(str, args)])
    return code, capsys.readouterr().err.strip()


def test_tp2_legacy_checkpoint_converts_to_hf_with_megatrons_logits(tmp_path, capsys):
    want = _megatron_run(tmp_path, tp=2, pp=1, torch_dist=False)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    legacy, hf = tmp_path / "legacy", tmp_path / "hf"
    code, err = _cli(
        capsys, "--input", legacy, "--output", hf, "--to", "hf", "--tokenizer", tokenizer
    )
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, atol=ATOL, rtol=0)


def test_qwen3_moe_at_ep2_converts_from_both_formats_with_megatrons_logits(tmp_path, capsys):
    """Megatron-Core's MoE GPTModel (qk-norm, 4 experts top-2, two per expert rank) saved
    at ep=2 in both formats -> a Qwen3-MoE folder with Megatron's logits; the experts of
    rank 1 land at 2 and 3 (each expert's weights differ, so a wrong index shows)."""
    want = _megatron_run(tmp_path, tp=1, pp=1, torch_dist=True, ep=2, moe="qwen3_moe")
    assert sorted(p.name for p in (tmp_path / "legacy" / "iter_0000010").iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    for fmt in ("legacy", "torch_dist"):
        hf = tmp_path / f"hf_{fmt}"
        code, err = _cli(capsys, "--input", tmp_path / fmt, "--output", hf, "--to", "hf")
        assert code == 0, err
        config = transformers.AutoConfig.from_pretrained(hf)
        assert (config.model_type, config.num_experts, config.norm_topk_prob) == (
            "qwen3_moe",
            EXPERTS,
            True,
        )
        torch.testing.assert_close(_hf_logits(hf), want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_mixtral_at_tp2_ep2_converts_to_hf_and_mindspeed_with_megatrons_logits(tmp_path, capsys):
    """No qk-norm: a Mixtral folder. Experts split over tp (gate/up halves per rank) and
    spread over ep, from 4 legacy rank files `mp_rank_TT_EEE`; --to mindspeed at ep=2."""
    want = _megatron_run(tmp_path, tp=2, pp=1, torch_dist=True, ep=2, moe="mixtral")
    for fmt in ("legacy", "torch_dist"):
        hf = tmp_path / f"hf_{fmt}"
        code, err = _cli(capsys, "--input", tmp_path / fmt, "--output", hf, "--to", "hf")
        assert code == 0, err
        assert transformers.AutoConfig.from_pretrained(hf).model_type == "mixtral"
        torch.testing.assert_close(_hf_logits(hf), want, atol=ATOL, rtol=0)
    ours = tmp_path / "ours"
    code, err = _cli(
        capsys, "--input", tmp_path / "legacy", "--output", ours, "--to", "mindspeed", "--ep", 2
    )
    assert code == 0, err
    model, _ = load_model(ours, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_virtual_pipeline_chunks_convert_with_megatrons_logits(tmp_path, capsys):
    """pp=2 with two virtual-pipeline chunks per stage (layers 0, 2 on stage 0; 1, 3 on
    stage 1): both formats -> HF with Megatron's logits (a wrong layer order shows)."""
    logits = run_distributed(_build_save_forward_vpp, 2, str(tmp_path), timeout=300)
    want = next(r for r in logits if r is not None)
    for fmt in ("legacy", "torch_dist"):
        hf = tmp_path / f"hf_{fmt}"
        code, err = _cli(capsys, "--input", tmp_path / fmt, "--output", hf, "--to", "hf")
        assert code == 0, err
        torch.testing.assert_close(_hf_logits(hf), want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_tp2_pp2_legacy_and_torch_dist_convert_to_hf_and_mindspeed(tmp_path, capsys):
    want = _megatron_run(tmp_path, tp=2, pp=2, torch_dist=True)
    for fmt in ("legacy", "torch_dist"):
        hf = tmp_path / f"hf_{fmt}"
        code, err = _cli(capsys, "--input", tmp_path / fmt, "--output", hf, "--to", "hf")
        assert code == 0, err
        assert "holds no tokenizer" in err and "--tokenizer" in err
        torch.testing.assert_close(_hf_logits(hf), want, atol=ATOL, rtol=0)
    ours = tmp_path / "ours"
    source = tmp_path / "torch_dist"
    code, err = _cli(
        capsys,
        "--input",
        source,
        "--from",
        "megatron",
        "--output",
        ours,
        "--to",
        "mindspeed",
        "--tp",
        "2",
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
    model, _ = load_model(ours, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), want, atol=ATOL, rtol=0)
    # both formats hold the same tensors, streamed in the same order: the same file
    a, b = (
        (tmp_path / f"hf_{f}" / "model.safetensors").read_bytes() for f in ("legacy", "torch_dist")
    )
    assert a == b


def test_hostile_legacy_checkpoint_is_refused_and_nothing_is_written(tmp_path, capsys):
    root = tmp_path / "megatron"
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    marker = tmp_path / "pwned"
    plant_hostile_torch_file(rank / "model_optim_rng.pt", marker)
    for to in ("hf", "mindspeed"):
        code, err = _cli(capsys, "--input", root, "--output", tmp_path / "out", "--to", to)
        assert code == 2
        assert err.startswith("error: ") and len(err.splitlines()) == 1
        assert "model_optim_rng.pt" in err and "refused" in err
        assert not marker.exists()
        assert [p.name for p in tmp_path.iterdir()] == ["megatron"]


def test_split_qkv_undoes_megatrons_per_group_interleave():
    d, rows = HIDDEN // HEADS, HIDDEN
    q, k, v = (torch.randn(n * d, rows) for n in (HEADS, GROUPS, GROUPS))
    per = HEADS // GROUPS
    fused = torch.cat(
        [q.reshape(GROUPS, per * d, rows), k.reshape(GROUPS, d, rows), v.reshape(GROUPS, d, rows)],
        dim=1,
    ).reshape(-1, rows)  # MindSpeed-LLM's / Megatron's layout
    for got, expected in zip(split_qkv(fused, HEADS, GROUPS, d), (q, k, v), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.slow
def test_training_checkpoints_enums_and_numpy_rng_load_inert(tmp_path):
    """A training run's rank file also holds Megatron enums in its args and numpy's RNG
    state; in a process that never imported megatron they unpickle into stand-ins."""
    import subprocess
    import sys

    file = tmp_path / "model_optim_rng.pt"
    script = f"""
import argparse, pickle, random, sys, numpy as np, torch
from megatron.core.transformer.enums import AttnBackend
rng = {{"np_rng_state": np.random.get_state(), "random_rng_state": random.getstate()}}
args = argparse.Namespace(attention_backend=AttnBackend.auto, num_layers=2)
torch.save({{"args": args, "rng_state": [rng], "model": {{"w": torch.ones(2)}}}}, {str(file)!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    check = f"""
import sys
from mindspeed_tools.convert.megatron import safe_torch_load
state = safe_torch_load(__import__("pathlib").Path({str(file)!r}))
assert not any(m.startswith("megatron") for m in sys.modules), "megatron was imported"
assert state["args"].num_layers == 2
assert type(state["args"].attention_backend).__name__ == "AttnBackend"
assert state["model"]["w"].tolist() == [1.0, 1.0]
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_hf_to_megatron_tp2_pp2_round_trips_and_megatron_core_loads_it(tmp_path, capsys):
    """HF -> Megatron legacy (tp=2, pp=2) -> HF is bit-identical, and Megatron-Core's GPTModel
    loads every rank file strictly and gives transformers' logits."""
    from safetensors.torch import load_file

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    source = tmp_path / "hf"
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=_gen(name)))
    model.save_pretrained(source)
    want = _hf_logits(source)
    mega, back = tmp_path / "megatron", tmp_path / "back"
    code, err = _cli(
        capsys, "--input", source, "--output", mega, "--to", "megatron", "--tp", 2, "--pp", 2
    )
    assert code == 0, err
    assert (mega / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    code, err = _cli(capsys, "--input", mega, "--output", back, "--to", "hf")
    assert code == 0, err
    a, b = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got = _megatron_run(tmp_path / "unused", tp=2, pp=2, torch_dist=False, load=str(mega))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("pp", "mapped"), [(1, False), (2, False), (2, True)])
def test_qwen2_with_tied_embeddings_round_trips_through_megatron(
    tmp_path, capsys, monkeypatch, pp, mapped
):
    """q/k/v biases fused like the weights, a tied output kept on the last stage only when
    it is not the first: HF -> Megatron (tp=2) -> HF is bit-identical; also where torch
    (before 2.10) gives no storage offsets and the rank files are memory-mapped instead."""
    from safetensors.torch import load_file

    from mindspeed_tools.convert.megatron import legacy

    if mapped:
        monkeypatch.setattr(legacy, "_has_offsets", lambda state: False)

    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    source, mega, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    transformers.Qwen2ForCausalLM(config).save_pretrained(source)
    code, err = _cli(
        capsys, "--input", source, "--output", mega, "--to", "megatron", "--tp", 2, "--pp", pp
    )
    assert code == 0, err
    code, err = _cli(capsys, "--input", mega, "--output", back, "--to", "hf")
    assert code == 0, err
    a, b = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "self_attn.q_proj.bias" in " ".join(a)


def _rank_file(root: Path, rank_dir: str, args: argparse.Namespace, iteration: int = 1) -> None:
    folder = root / f"iter_{iteration:07d}" / rank_dir
    folder.mkdir(parents=True)
    torch.save({"args": args, "iteration": iteration, "model": {}}, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shared_experts", "args.moe_shared_expert_intermediate_size=64: shared experts are"),
        ("missing_expert_rank", "mp_rank_00_001/model_optim_rng.pt is missing (tp=1, pp=1, ep=2)"),
        ("missing_rank", "mp_rank_01/model_optim_rng.pt is missing (tp=2, pp=1)"),
        ("missing_iteration", "names iteration 7, but"),
        ("layernorm", "args.normalization='LayerNorm': only RMSNorm models are converted"),
        ("mla", "args.multi_latent_attention=True: DeepSeek's multi-latent attention is not"),
    ],
)
def test_bad_megatron_checkpoints_are_one_line(tmp_path, capsys, case, expected):
    root = tmp_path / "megatron"
    moe = case in ("shared_experts", "missing_expert_rank")
    args = _megatron_args(
        tp=2 if case == "missing_rank" else 1,
        pp=1,
        ep=2 if case == "missing_expert_rank" else 1,
        moe="mixtral" if moe else None,
    )
    if case == "shared_experts":
        args.moe_shared_expert_intermediate_size = 64
    if case == "mla":
        args.multi_latent_attention = True
    if case == "layernorm":
        args.normalization = "LayerNorm"
    _rank_file(root, "mp_rank_00_000" if case == "missing_expert_rank" else "mp_rank_00", args)
    if case == "missing_iteration":
        (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    code, err = _cli(capsys, "--input", root, "--output", tmp_path / "out", "--to", "hf")
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("truncated_rank", "mp_rank_01/model_optim_rng.pt is truncated, corrupt or unsafe"),
        ("missing_distcp", "__0_0.distcp is missing"),
        ("truncated_distcp", "__0_0.distcp is truncated"),
    ],
)
def test_truncated_or_missing_files_are_one_line_and_nothing_is_written(
    tmp_path, capsys, case, expected
):
    """Found while the files' structure is read, before the first tensor: one line naming
    the file, exit 2, no output folder."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "megatron"
    embedding = {"embedding.word_embeddings.weight": torch.randn(VOCAB, HIDDEN)}
    folder = root / "iter_0000001"
    if case == "truncated_rank":
        for tp in range(2):
            _rank_file(root, f"mp_rank_{tp:02d}", _megatron_args(2, 1))
            torch.save({"args": _megatron_args(2, 1), "model": embedding},
                       folder / f"mp_rank_{tp:02d}" / "model_optim_rng.pt")  # fmt: skip
        file = folder / "mp_rank_01" / "model_optim_rng.pt"
    else:
        dcp.save(embedding, checkpoint_id=str(folder), no_dist=True)
        args = _megatron_args(1, 1)
        args.ckpt_format = "torch_dist"
        torch.save({"args": args, "iteration": 1}, folder / "common.pt")
        (root / "latest_checkpointed_iteration.txt").write_text("1\n")
        file = folder / "__0_0.distcp"
    if case == "missing_distcp":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    for to in ("hf", "mindspeed"):
        code, err = _cli(capsys, "--input", root, "--output", tmp_path / "out", "--to", to)
        assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]


def test_a_rank_file_copied_over_another_and_a_shape_error_name_the_input(tmp_path, capsys):
    """Rank 0's file copied over rank 1's (tp=2, pp=2) would convert into a wrong model: it
    is refused naming both files. Args that do not fit the tensors name the input folder,
    not the converter's staging folder. Nothing is written either time."""
    import shutil

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    mega, out = tmp_path / "megatron", tmp_path / "out"
    assert _cli(capsys, "--input", tmp_path / "hf", "--output", mega, "--to", "megatron",
                "--tp", 2, "--pp", 2)[0] == 0  # fmt: skip
    iteration = mega / "iter_0000001"
    for copied in ("mp_rank_01_000", "mp_rank_00_001"):  # another tp rank, another stage
        broken = tmp_path / f"copied-{copied}"
        shutil.copytree(mega, broken)
        shutil.copy(iteration / "mp_rank_00_000" / "model_optim_rng.pt",
                    broken / "iter_0000001" / copied / "model_optim_rng.pt")  # fmt: skip
        code, err = _cli(capsys, "--input", broken, "--output", out, "--to", "hf")
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"{copied}/model_optim_rng.pt holds the same tensors as " in err, err
        assert "mp_rank_00_000/model_optim_rng.pt" in err and "copied over another" in err, err
        assert not out.exists()
    for rank in iteration.iterdir():  # every rank's args: a wider MLP than its tensors
        file = rank / "model_optim_rng.pt"
        state = torch.load(file, weights_only=False)
        state["args"].ffn_hidden_size = 2 * FFN
        torch.save(state, file)
    code, err = _cli(capsys, "--input", mega, "--output", out, "--to", "hf")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"error: {iteration}: tensor " in err and ".tmp-" not in err, err
    assert f"expects ({2 * FFN}, {HIDDEN})" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
