"""`mindspeed grpo --lora.rank 8` through the CLI: a run from a Hugging Face folder
(`grpo.init_from`) trains and saves the adapters alone and resumes exactly; its checkpoints
leave as a peft adapter that `peft.PeftModel.from_pretrained` loads on the base (the oracle)
with the logits `load_model` (base + adapters merged on load) and `convert --merge-lora`
give; what LoRA RL refuses is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_align.rl.cli import main
from mindspeed_align.rl.data import demo_records
from mindspeed_core.cli import guarded
from mindspeed_core.cli import run as cli
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.demo import ensure_demo_data
from mindspeed_llm.models.checkpoint_io import tensor_metadata

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo-lora")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(40, seed=7)))
    models_hf.make_hf("llama").save_pretrained(folder / "base")  # vocab 512: the demo tokenizer's
    return folder


def _args(folder, run, *extra):
    return [
        f"--data.prompts={folder / 'prompts.jsonl'}", f"--data.tokenizer={ensure_demo_data().tokenizer}",
        "--data.eval_prompts=8", "--data.seq_len=48", "--grpo.n=4", "--grpo.max_new_tokens=3",
        "--grpo.reward_workers=0", "--grpo.kl_coef=0.05", "--train.global_batch=16",
        "--train.micro_batch=8", "--train.steps=4", "--model.ops_impl=reference",
        f"--model.hf_path={folder / 'base'}", f"--grpo.init_from={folder / 'base'}",
        "--lora.rank=8", "--optim.lr=2e-2",
        f"--logging.run_dir={folder / run}", "--logging.log_interval=1",
        "--logging.progress=false", "--logging.tensorboard=false", *extra,
    ]  # fmt: skip


# every linear layer and the output layer (peft's lm_head), as the demo's LoRA adapts it
EVERY_TARGET = "--lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"


def test_grpo_lora_saves_adapters_only_resumes_exactly_and_exports_for_peft(task, tmp_path):
    peft = pytest.importorskip("peft")
    pytest.importorskip("mindspeed_tools")  # `mindspeed convert`
    import transformers

    assert guarded(main, _args(task, "whole", EVERY_TARGET)) == 0
    whole = read_metrics(task / "whole" / "metrics.jsonl")
    assert whole[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # adapters start at B = 0
    assert whole[-1]["kl"] > 0  # the reference (adapters off) stays the base
    saved = tensor_metadata(task / "whole" / "checkpoints" / "step_4")
    assert saved and all(".lora_" in k for k in saved)
    assert len(saved) == (7 * 2 + 1) * 2  # (q k v o gate up down x 2 layers, lm_head) x A, B
    assert guarded(main, _args(task, "split", EVERY_TARGET, "--train.exit_at_step=2")) == 0
    assert guarded(main, _args(task, "split", EVERY_TARGET)) == 0
    split = read_metrics(task / "split" / "metrics.jsonl")
    assert [m["step"] for m in split] == [1, 2, 3, 4]
    for a, b in zip(whole, split, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)

    checkpoints = task / "whole" / "checkpoints"
    assert cli(["convert", "--input", str(checkpoints), "--output", str(tmp_path / "adapter"),
                "--to", "peft"]) == 0  # fmt: skip
    assert cli(["convert", "--input", str(checkpoints), "--output", str(tmp_path / "merged"),
                "--to", "hf", "--merge-lora"]) == 0  # fmt: skip
    from mindspeed_llm.loading import load_model

    ours, _ = load_model(checkpoints, ops_impl="reference")
    base = transformers.AutoModelForCausalLM.from_pretrained(task / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = models_hf.tokens()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        want = theirs(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        assert (want - base_logits).abs().max() > 1e-4  # the adapters trained


def test_bad_lora_inputs_are_one_line(task, capsys):
    cases = {
        "--lora.rank=-1": "lora.rank=-1 must be >= 0",
        "--lora.quantize=nf4": "lora.quantize=nf4: mindspeed grpo trains plain LoRA adapters",
        "--lora.targets=[qkv]": "lora.targets: unknown layer 'qkv'",
        "--lora.dropout=1.5": "lora.dropout=1.5 must be in [0, 1)",
    }
    # a model LoRA cannot adapt as asked: DeepSeek-V3's low-rank queries have no q_proj
    latent = ["--model.family=deepseek_v3", "--lora.targets=[q_proj]"]
    cases[" ".join(latent)] = "lora.targets: 'q_proj' matches no linear layer of the model"
    for arg, expected in cases.items():
        base = [
            a
            for a in _args(task, "bad")
            if not a.startswith(("--model.hf_path", "--grpo.init_from"))
        ]
        assert guarded(main, [*base, *arg.split()]) == 2, arg
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, (arg, err)
    assert not (task / "bad").exists()  # nothing half-written


def test_ppo_with_lora_trains_the_policy_adapters_and_a_whole_critic(task):
    """PPO's critic is a model of its own: it trains whole (its checkpoint holds every
    tensor) while the policy's holds the adapters alone; the KL in the reward is against the
    policy with its adapters off, 0 on the first step."""
    from mindspeed_align.rl.cli import ppo_main
    from mindspeed_core.checkpoint.verify import read_metadata

    args = [a.replace("--grpo.", "--ppo.") for a in _args(task, "ppo", "--train.steps=2")]
    assert guarded(ppo_main, args) == 0
    metrics = read_metrics(task / "ppo" / "metrics.jsonl")
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-7) and metrics[-1]["kl"] > 0
    step = task / "ppo" / "checkpoints" / "step_2"
    policy = tensor_metadata(step)
    assert policy and all(".lora_" in k for k in policy)
    critic = [k for k in read_metadata(step).state_dict_metadata if k.startswith("critic_model.")]
    assert any(k.endswith("attention.wq.weight") for k in critic)
    assert not any(".lora_" in k for k in critic)


def test_the_lora_demo_adapts_the_output_layer_unless_told_otherwise():
    """`mindspeed grpo --lora.rank 2` fills the fields left at their defaults from
    `LORA_DEMO` (a copy of its targets); what the user set stays."""
    from mindspeed_align.rl.cli import LORA_DEMO, _demo_defaults
    from mindspeed_align.rl.config import GRPOConfig
    from mindspeed_llm.peft import LoRAConfig

    cfg = GRPOConfig(lora=LoRAConfig(rank=2))
    _demo_defaults(cfg, "grpo")
    assert cfg.lora.targets[-1] == "lm_head" and cfg.lora.targets == LORA_DEMO["lora.targets"]
    assert (cfg.lora.alpha, cfg.optim.lr) == (4.0, 3e-3)
    cfg.lora.targets.append("q_proj")
    assert LORA_DEMO["lora.targets"].count("q_proj") == 1  # not shared
    own = GRPOConfig(lora=LoRAConfig(rank=8, alpha=8.0, targets=["v_proj"]))
    _demo_defaults(own, "grpo")
    assert (own.lora.targets, own.lora.alpha) == (["v_proj"], 8.0)
    full = GRPOConfig()
    _demo_defaults(full, "grpo")
    assert full.optim.lr == 1e-3 and "lm_head" not in full.lora.targets  # no LoRA: untouched


@pytest.mark.slow
def test_lora_demo_reward_rises(tmp_path):
    """`mindspeed grpo --lora.rank 2` (2-6 minutes on 2 cores): the demo's LoRA adapts
    every linear layer and the output layer (`LORA_DEMO`: with the head frozen the held-out
    greedy reward stayed at 0.70) and the held-out greedy reward passes 0.8; a rollout
    through a copy of the policy (one-step off-policy, 3 steps from the demo's warm-up) is
    sent the adapters alone, at most 5% of the whole weights' bytes."""
    from mindspeed_align.rl.cli import LORA_DEMO, grpo
    from mindspeed_align.rl.config import (
        GRPOConfig,
        GRPOLoggingSection,
        GRPOSection,
        GRPOTrainSection,
    )
    from mindspeed_llm.models import Transformer, build_model_config
    from mindspeed_llm.peft import LoRAConfig

    cfg = GRPOConfig(logging=GRPOLoggingSection(run_dir=tmp_path / "grpo", progress=False),
                     lora=LoRAConfig(rank=2))  # fmt: skip
    summary = grpo(cfg)
    (greedy0, sampled0), (greedy1, sampled1) = summary["reward_before"], summary["reward_after"]
    print(f"grpo lora demo, held-out reward: greedy {greedy0:.3f} -> {greedy1:.3f}, sampled "
          f"{sampled0:.3f} -> {sampled1:.3f}")  # fmt: skip
    assert cfg.optim.lr == LORA_DEMO["optim.lr"] and cfg.lora.alpha == LORA_DEMO["lora.alpha"]
    assert cfg.lora.targets == LORA_DEMO["lora.targets"]
    assert cfg.grpo.init_from is not None  # config.yaml names the base
    assert greedy1 > 0.8 and sampled1 > sampled0 + 0.2, summary
    saved = tensor_metadata(tmp_path / "grpo" / "checkpoints" / "step_300")
    assert saved and all(".lora_" in k for k in saved)
    assert any(k.startswith("output.lora_") for k in saved)
    adapters = sum(dtype.itemsize * torch.Size(shape).numel() for dtype, shape in saved.values())

    sync = GRPOConfig(
        grpo=GRPOSection(init_from=cfg.grpo.init_from, async_rollout="one_step", reward_workers=0),
        lora=LoRAConfig(rank=2, alpha=cfg.lora.alpha, targets=cfg.lora.targets),
        train=GRPOTrainSection(steps=3),
        logging=GRPOLoggingSection(run_dir=tmp_path / "sync", log_interval=1, progress=False),
    )  # fmt: skip
    grpo(sync)
    sent = [m["rollout/weight_sync_bytes"] for m in read_metrics(tmp_path / "sync" / "metrics.jsonl")]
    base = Transformer(build_model_config("llama", "debug")).state_dict()
    whole = sum(t.numel() * t.element_size() for t in base.values()) + adapters
    print(f"sync bytes a step {sent}, whole weights {whole} ({sent[-1] / whole:.2%})")
    assert sent == [adapters] * 3 and adapters <= 0.05 * whole


fake_vllm = import_sibling(__file__, "test_rl_vllm").fake_vllm  # the stand-in engine


def test_grpo_lora_on_vllm_sends_the_merged_model_each_step(task, fake_vllm):
    """`rollout_engine vllm` with LoRA: the engine (a stand-in) gets the merged model, the
    base's size in bytes and names, at every step."""
    from mindspeed_llm.models import Transformer, build_model_config

    python, _ = fake_vllm
    drop = ("--model.hf_path", "--grpo.init_from", "--train.steps")
    args = [a for a in _args(task, "vllm") if not a.startswith(drop)] + [
        "--train.steps=2", "--grpo.rollout_engine=vllm", f"--grpo.vllm_python={python}",
        "--model.flavor=debug-h32"]  # fmt: skip
    assert guarded(main, args) == 0
    metrics = read_metrics(task / "vllm" / "metrics.jsonl")
    base = sum(
        p.numel() * 4 for p in Transformer(build_model_config("llama", "debug-h32")).parameters()
    )
    assert [m["rollout/weight_sync_bytes"] for m in metrics] == [base] * 2
    assert metrics[-1]["kl"] > 0
