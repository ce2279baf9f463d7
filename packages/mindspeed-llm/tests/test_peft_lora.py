"""LoRA against peft (the oracle nobody here wrote): on the transformers model of the same
weights, `get_peft_model` with the same adapters gives our logits and A/B gradients, before
and after one AdamW step (fp32, 1e-5); under tp=2 (and tp=2 x dp_shard=2) the adapters
follow the base's placement and give one process's logits and gradients, QLoRA's NF4 base
included; a LoRA run on the
shared Trainer checkpoints only its adapters and resumes exactly."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mindspeed_core.config import load_config
from mindspeed_core.distributed import current_distributed, destroy_distributed, init_distributed
from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.models import build_model_config
from mindspeed_llm.models.checkpoint_io import tensor_metadata
from mindspeed_llm.peft import (
    LoRAConfig,
    adapted_modules,
    apply_lora,
    lora_trainer_options,
    lora_transform,
)
from mindspeed_llm.peft.names import to_peft_names
from mindspeed_llm.train.build import build_model
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.trainer import Trainer

models_hf = import_sibling(__file__, "models_hf")
make_hf, ours_from, tokens = models_hf.make_hf, models_hf.ours_from, models_hf.tokens

peft = pytest.importorskip("peft")

# our names and Hugging Face's mixed, as a user may write them
TARGETS = ["wq", "k_proj", "v_proj", "o_proj", "w1", "up_proj", "down_proj"]


def _randomise_b(model, seed=5):
    """B starts at 0 (so A's gradient would be 0): draw it, whole, then keep this rank's share."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, linear in adapted_modules(model):
            b = linear.lora_B.weight
            full = torch.randn(b.shape, generator=gen) * 0.05
            if isinstance(b, DTensor):
                full = distribute_tensor(full, b.device_mesh, b.placements)
            b.copy_(full)


def _loss(logits, x):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def test_lora_equals_peft_logits_and_grads_before_and_after_a_step():
    hf = make_hf("qwen2")
    ours = ours_from(hf).train()
    names = apply_lora(ours, LoRAConfig(rank=4, alpha=8, rslora=True, targets=TARGETS))
    assert len(names) == 7 * 2
    _randomise_b(ours)
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"])  # fmt: skip
    theirs = peft.get_peft_model(hf, config).train()
    mine = {k: p for k, p in ours.named_parameters() if p.requires_grad}
    assert all(".lora_" in k for k in mine) and len(mine) == 28  # the base is frozen
    to_peft = to_peft_names(mine, ours.config)
    peft_params = dict(theirs.named_parameters())
    pairs = [
        (p, peft_params[to_peft[k].replace(".weight", ".default.weight")]) for k, p in mine.items()
    ]
    with torch.no_grad():
        for p, q in pairs:
            q.copy_(p)
    opt_ours = torch.optim.AdamW([p for p, _ in pairs], lr=1e-2)
    opt_theirs = torch.optim.AdamW([q for _, q in pairs], lr=1e-2)
    assert sum(q.requires_grad for q in theirs.parameters()) == len(pairs)
    x = tokens()
    for step in range(2):
        logits, peft_logits = ours(x), theirs(input_ids=x).logits
        torch.testing.assert_close(logits, peft_logits, atol=1e-5, rtol=1e-5, msg=f"step {step}")
        _loss(logits, x).backward()
        _loss(peft_logits, x).backward()
        for p, q in pairs:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        assert all(p.grad.abs().sum() > 0 for p, _ in pairs)
        opt_ours.step(), opt_theirs.step(), opt_ours.zero_grad(), opt_theirs.zero_grad()


def test_a_lora_target_that_matches_nothing_is_one_line():
    with pytest.raises(ConfigError, match=r"lora.targets: unknown layer 'qproj'"):
        LoRAConfig(rank=4, targets=["q_proj", "qproj"])
    mla = build_model_config("deepseek_v3", flavor="debug", ops_impl="reference")
    from mindspeed_llm.models import get_model_spec

    model = get_model_spec("deepseek_v3").build(mla)  # latent attention: no q_proj
    with pytest.raises(ConfigError, match=r"'q_proj' matches no linear layer") as err:
        apply_lora(model, LoRAConfig(rank=4, targets=["gate_proj", "q_proj"]))
    assert "\n" not in str(err.value)


SEQ = 16


def _layouts(layouts, config=None, lora=None):
    """Logits, A/B gradients and the logits after one AdamW step, per layout (full tensors)."""
    config = config or build_model_config("llama", flavor="debug", ops_impl="reference")
    x = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    lora = lora or LoRAConfig(rank=4, alpha=8, targets=TARGETS)
    after_tp = lora_transform(lora)
    out = {}
    for name, (parallel, world) in layouts.items():
        dims = parallel.dims(world).build("cpu")
        built = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ,
                            after_tp=after_tp)  # fmt: skip
        model = built.model
        _randomise_b(model)  # values once materialised (hooks run on the meta device)
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        placements = {k: tuple(p.placements) for k, p in params.items() if isinstance(p, DTensor)}
        # SGD: AdamW's first step is each gradient's sign, so a gradient within rounding of 0
        # (tp sums in another order) would flip a whole lr-sized update
        opt = torch.optim.SGD(params.values(), lr=1.0)
        logits = model(x)
        _loss(logits, x).backward()
        grads = {k: _full(p.grad) for k, p in params.items()}
        opt.step()
        with torch.no_grad():
            after = model(x)
        out[name] = (_full(logits).detach(), grads, _full(after), placements)
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(results):
    for result in results:
        want_logits, want_grads, want_after, _ = result.pop("one")
        assert len(want_grads) == 28
        for name, (logits, grads, after, _) in result.items():
            torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(after, want_after, atol=1e-5, rtol=1e-5, msg=name)
            assert grads.keys() == want_grads.keys(), name
            for k, g in grads.items():
                torch.testing.assert_close(
                    g, want_grads[k], atol=1e-5, rtol=1e-4, msg=f"{name} {k}"
                )
    return results


def _tp2():
    layouts = {
        "one": (ParallelConfig(), 1),
        "tp2": (ParallelConfig(tp=2, loss_parallel=False), None),
    }
    base = build_model_config("llama", flavor="debug", ops_impl="reference")
    wider = dataclasses.replace(base, hidden_size=128, intermediate_size=256, head_dim=32)
    qlora = LoRAConfig(rank=4, alpha=8, quantize="nf4")  # 64-blocks never cross a tp shard
    return _layouts(layouts), _layouts(layouts, wider, qlora)


@pytest.mark.distributed
def test_lora_and_qlora_under_tp2_equal_one_process_and_follow_the_base_placement():
    results = run_distributed(_tp2, 2, timeout=600)
    _compare([qlora for _, qlora in results])
    for result in _compare([lora for lora, _ in results]):
        placements = result["tp2"][3]
        assert placements["layers.0.attention.wq.lora_A.weight"] == (Replicate(),)
        assert placements["layers.0.attention.wq.lora_B.weight"] == (Shard(0),)
        assert placements["layers.0.attention.wo.lora_A.weight"] == (Shard(1),)
        assert placements["layers.0.feed_forward.w2.lora_B.weight"] == (Replicate(),)


def _tp2_dp2():
    both = ParallelConfig(tp=2, dp_shard=2, loss_parallel=False)
    sp = ParallelConfig(tp=2, dp_shard=2, loss_parallel=False, sequence_parallel=True)
    lora = _layouts(
        {"one": (ParallelConfig(), 1), "tp2_dp2": (both, None), "tp2_dp2_sp": (sp, None)}
    )
    base = build_model_config("llama", flavor="debug", ops_impl="reference")
    wider = dataclasses.replace(base, hidden_size=128, intermediate_size=256, head_dim=32)
    qlora = LoRAConfig(rank=4, alpha=8, quantize="nf4")
    return lora, _layouts({"one": (ParallelConfig(), 1), "tp2_dp2": (both, None)}, wider, qlora)


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_and_qlora_under_tp2_x_dp_shard2_and_sequence_parallel_equal_one_process():
    results = run_distributed(_tp2_dp2, 4, timeout=900)
    _compare([lora for lora, _ in results])
    _compare([qlora for _, qlora in results])


# -- the shared Trainer: adapters only in the optimizer and the checkpoints -----------------
def _train(tmp_path, run, *extra, info=None):
    args = ["--train.steps=4", "--train.micro_batch=2", "--train.global_batch=4",
            "--data.seq_len=32", "--optim.warmup_steps=1", "--optim.lr=3e-2",
            "--checkpoint.interval=2", "--logging.log_interval=1", "--logging.progress=false",
            "--logging.tensorboard=false", "--model.ops_impl=reference",
            f"--logging.run_dir={tmp_path / run}", *extra]  # fmt: skip
    lora = LoRAConfig(rank=4, alpha=8, targets=["q_proj", "v_proj"])
    owns_group = info is None
    info = info or init_distributed(device_type="cpu")
    trainer = Trainer(load_config(PretrainConfig, None, args), info, **lora_trainer_options(lora))
    try:
        optimised = {id(p) for p in trainer.parts.optimizer.parameters()}
        parts = trainer.parts.model.parts  # [model], or this rank's pipeline stages
        trainable = [n for part in parts for n, p in part.named_parameters() if id(p) in optimised]
        wq = next(adapted_modules(parts[0]))[1]
        base = wq.weight.detach().clone()
        trainer.run()
        base_kept = torch.equal(base, wq.weight)
    finally:
        if owns_group:
            destroy_distributed()
    return read_metrics(tmp_path / run / "metrics.jsonl"), trainable, base_kept


def test_a_lora_run_trains_only_adapters_saves_only_them_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    straight, trainable, base_kept = _train(tmp_path, "straight")
    assert base_kept and len(trainable) == 2 * 2 * 2  # q, v x A, B x 2 layers
    assert all(".lora_" in n for n in trainable)
    assert straight[-1]["loss"] < straight[0]["loss"]
    saved = tensor_metadata(tmp_path / "straight" / "checkpoints" / "step_4")
    assert set(saved) == set(trainable)
    _train(tmp_path, "resumed", "--train.exit_at_step=2")
    resumed, _, _ = _train(tmp_path, "resumed")
    keys = ("loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in straight]


def _pp2(tmp_path):
    import os

    os.environ["MINDSPEED_CACHE"] = str(tmp_path / "cache")
    metrics, trainable, _ = _train(
        tmp_path, "pp2", "--parallel.pp=2", info=current_distributed("cpu")
    )
    return metrics, trainable


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lora_run_under_pp2_equals_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    one, trainable, _ = _train(tmp_path, "one")
    (pp2, stage0), (_, stage1) = run_distributed(_pp2, 2, tmp_path, timeout=900)
    assert sorted(stage0 + stage1) == sorted(trainable)  # each stage adapts its own layers
    for a, b in zip(one, pp2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    saved = tensor_metadata(tmp_path / "pp2" / "checkpoints" / "step_4")
    assert set(saved) == set(trainable)
