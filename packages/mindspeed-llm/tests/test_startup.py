"""Start-up on the meta device (S2): under every layout each rank's shards hold exactly what
one process draws with the same seed, or reads from a Hugging Face folder, bit for bit, for
every family; padding rows are zero; together the ranks hold every tensor.

The CI case runs four families that cover each way a tensor is made (renamed, padded and
tied vocabulary, stacked experts read one expert at a time, fused q/k/v split, latent
attention with multi-token prediction); the slow case runs every family.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.parallel.materialize import local_box, plain_name
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec, model_families
from mindspeed_llm.train.build import build_model

SEED = 7
LAYOUTS = {
    "tp2_dp_shard2": ParallelConfig(tp=2, dp_shard=2),
    "pp2_tp2": ParallelConfig(pp=2, tp=2),
    "pp2_virtual_dp_shard2": ParallelConfig(
        pp=2, virtual_stages=2, pp_schedule="Interleaved1F1B", layers_per_stage=[0, 1, 1, 0]
    ),
    "cp2_dp_shard2": ParallelConfig(cp=2, dp_shard=2),
    "hsdp": ParallelConfig(dp_replicate=2, dp_shard=2),
    "ep2_dp_shard4": ParallelConfig(ep=2),
    "ep2_tp2_dp_shard2": ParallelConfig(ep=2, tp=2, dp_shard=2),
}
CI_FAMILIES = ("llama_odd_vocab_tied", "qwen3_moe", "phi3", "deepseek_v3")


def _config(name: str):
    if name == "llama_odd_vocab_tied":  # tp pads 500 rows to 512; pp keeps a tied copy
        base = build_model_config("llama", "debug", ops_impl="reference")
        return dataclasses.replace(base, vocab_size=500, tie_word_embeddings=True)
    config = build_model_config(name, "debug", ops_impl="reference")
    if config.num_experts:  # each layer's own balancing loss, so pp can split the layers
        config = dataclasses.replace(config, router_aux_loss_scope="layer")
    return config


def _build(config, parallel: ParallelConfig, world_size=None, hf_path=None):
    dims = parallel.dims(world_size).build("cpu")
    return build_model(
        config, dims, torch.device("cpu"), parallel=parallel, seed=SEED, seq_len=16,
        hf_path=hf_path,
    )  # fmt: skip


def _state(built) -> dict[str, torch.Tensor]:
    return {plain_name(n): t for part in built.parts for n, t in part.state_dict().items()}


def _save_hf(config, state: dict[str, torch.Tensor], folder: Path) -> Path:
    """`state` (one process's) as a Hugging Face folder, through the family's own adapter."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = get_model_spec(config.family).hf_adapter.to_hf(state, config)
    save_file({k: v.clone() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder


def _check_shards(built, one: dict[str, torch.Tensor], what: str) -> set[str]:
    """Every tensor of this rank equals its block of one process's (padding rows zero)."""
    held = set()
    for part in built.parts:
        for name, tensor in part.state_dict(keep_vars=True).items():
            name = plain_name(name)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            whole = one[name]
            if whole.shape[0] < tensor.shape[0]:  # vocabulary padding rows
                whole = torch.cat(
                    [whole, whole.new_zeros(tensor.shape[0] - whole.shape[0], *whole.shape[1:])]
                )
            want = local_box(tensor).of(whole)
            assert torch.equal(local.detach(), want), f"{what}: {name} differs from one process's"
            held.add(name)
    return held


def _run(families, layouts, folder: str):
    folder = Path(folder)
    checked = []
    for family in families:
        config = _config(family)
        one = _state(_build(config, ParallelConfig(), 1))
        hf = folder / family
        if dist.get_rank() == 0:
            _save_hf(config, one, hf)
        dist.barrier()
        from_hf = _state(_build(config, ParallelConfig(), 1, hf_path=hf))
        assert from_hf.keys() == one.keys()
        assert all(torch.equal(from_hf[k], one[k]) for k in one), f"{family}: HF round trip"
        for layout, parallel in layouts.items():
            if parallel.ep > 1 and not config.num_experts:
                continue
            if parallel.layers_per_stage:  # the first and last of 4 stages hold no layer
                half = config.num_layers // 2
                parallel = dataclasses.replace(
                    parallel, layers_per_stage=[0, half, config.num_layers - half, 0]
                )
            for source, path in (("seed", None), ("hf", hf)):
                what = f"{family} {layout} from {source}"
                try:
                    built = _build(config, parallel, hf_path=path)
                except (ConfigError, ParallelError) as err:  # a layout this family refuses
                    assert source == "seed", what
                    checked.append((what, f"refused: {err}"))
                    break
                held = _check_shards(built, one, what)
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, held)
                assert set().union(*everyone) == set(one), f"{what}: tensors nobody holds"
                checked.append((what, "ok"))
                del built
    return checked


@pytest.mark.distributed
def test_every_layout_starts_from_one_process_weights(tmp_path):
    results = run_distributed(_run, 4, CI_FAMILIES, LAYOUTS, str(tmp_path), timeout=900)
    outcome = dict(results[0])
    for what in ("llama_odd_vocab_tied pp2_virtual_dp_shard2", "qwen3_moe ep2_tp2_dp_shard2",
                 "qwen3_moe pp2_tp2", "phi3 tp2_dp_shard2", "deepseek_v3 ep2_dp_shard4"):  # fmt: skip
        assert outcome[f"{what} from hf"] == "ok", what
    refused = {w for w, o in outcome.items() if o != "ok"}
    assert not refused, refused  # multi-token prediction too: under tp, pp and cp
    assert len(outcome) == 48


@pytest.mark.slow
@pytest.mark.distributed
def test_every_family_starts_from_one_process_weights_in_every_layout(tmp_path):
    families = [f for f in model_families() if f != "llama"] + ["llama_odd_vocab_tied"]
    results = run_distributed(_run, 4, families, LAYOUTS, str(tmp_path), timeout=3000)
    outcome = dict(results[0])
    for family in families:  # every family starts in several layouts, from both sources
        ok = [w for w, o in outcome.items() if w.startswith(f"{family} ") and o == "ok"]
        assert len(ok) >= 4 and any(w.endswith("from hf") for w in ok), family


# -- bad Hugging Face folders: one line on every rank, exit 2, no hang ----------------------
def _bad_folders(root: Path) -> dict[str, Path]:
    """A good folder, then one whose q_proj does not fit the config, one whose index names
    a missing shard, one whose safetensors file is cut short."""
    config = _config("llama")
    one = _state(_build(config, ParallelConfig(), 1))
    good = _save_hf(config, one, root / "good")
    wrong = _save_hf(config, {**one, "layers.0.attention.wq.weight": torch.zeros(32, 64)},
                     root / "wrong_shape")  # fmt: skip
    missing = _save_hf(config, one, root / "missing_shard")
    (missing / "model.safetensors").rename(missing / "model-00001-of-00002.safetensors")
    names = get_model_spec("llama").hf_adapter.to_hf(one, config)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (missing / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cut = _save_hf(config, one, root / "truncated")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 1000])
    return {"good": good, "wrong_shape": wrong, "missing_shard": missing, "truncated": cut}


def _start_bad(folder: str):
    import contextlib
    import io

    from mindspeed_core.cli import guarded

    folders = {k: Path(v) for k, v in json.loads(folder).items()}
    out = {}
    for name, path in folders.items():
        config = _config("llama")
        err = io.StringIO()

        def start(path=path, config=config):
            _build(config, ParallelConfig(tp=2), hf_path=path)

        with contextlib.redirect_stderr(err):
            code = guarded(start)
        out[name] = (code, err.getvalue())
    return out


@pytest.mark.distributed
def test_a_folder_that_does_not_fit_is_one_line_on_every_rank(tmp_path):
    folders = {k: str(v) for k, v in _bad_folders(tmp_path).items()}
    for rank in run_distributed(_start_bad, 2, json.dumps(folders), timeout=300):
        assert rank["good"] == (0, "")
        for name, pattern in (
            ("wrong_shape", r"wrong_shape: tensor model.layers.0.self_attn.q_proj.weight "
                            r"\(ours: layers.0.attention.wq.weight\) has shape \(32, 64\)"),
            ("missing_shard", r"missing_shard/model.safetensors.index.json names "
                              r"model-00002-of-00002.safetensors, which does not exist"),
            ("truncated", r"truncated/model.safetensors is truncated"),
        ):  # fmt: skip
            code, err = rank[name]
            assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (name, err)
            assert re.search(pattern, err), (name, err)
