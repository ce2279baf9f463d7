"""Micro-batches by token budget (`train.micro_batch_tokens`).

- the plan: on hand-worked lengths, LPT puts each sample where Graham's rule says, packs
  each rank's samples whole within the budget and gives every rank as many micro-batches;
- SFT under dp_shard=2: the budget's step has the loss and gradients (1e-6) of the
  fixed-row micro-batches (`train.micro_batch` rows, the path TRL's loss checks) on the
  same samples, token- and sample-weighted, and its tokens per rank are closer;
- bad input: one line naming the field, exit 2.
"""

import json
import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.data.sft_templates import TEMPLATES
from mindspeed_llm.data.token_budget import balance_ranks, plan_micro_batches, rank_tokens
from mindspeed_llm.pretrain import main as pretrain_main
from mindspeed_llm.sft import main
from mindspeed_llm.train.config import TrainSection
from mindspeed_llm.train.sft_config import SFTConfig

chat_tests = import_sibling(__file__, "test_chat_template")
models_hf = import_sibling(__file__, "models_hf")
run_args = import_sibling(__file__, "test_sft_train").run_args


def test_lpt_by_hand():
    # longest first onto the lighter rank (ties: rank 0):
    # 100 -> r0 (100); 90 -> r1 (90); 60 -> r1 (150); 50 -> r0 (150); 30 -> r0 (180); 10 -> r1 (160)
    assert balance_ranks([100, 90, 60, 50, 30, 10], 2) == [[0, 3, 4], [1, 2, 5]]


def test_plan_packs_whole_samples_and_equalises_counts():
    lengths = [60, 60, 40, 40, 20]
    # LPT: r0 = 60, 40, 20 (120); r1 = 60, 40 (100). Budget 100: r0 packs into two
    # micro-batches (60 + 40, 20), r1 into one, which is split to match r0's count.
    plans = plan_micro_batches(lengths, 2, 100)
    assert plans == [[[0, 2], [4]], [[1], [3]]]
    assert rank_tokens(lengths, plans) == [120, 100]
    # a rank without a sample still runs the step's count: one empty micro-batch
    assert plan_micro_batches([10], 2, 16) == [[[0]], [[]]]
    # on many mixed lengths: every sample once, within the budget, equal counts
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 2049, (64,), generator=gen).tolist()
    plans = plan_micro_batches(lengths, 4, 4096)
    flat = sorted(i for plan in plans for mb in plan for i in mb)
    assert flat == list(range(64))
    assert all(sum(lengths[i] for i in mb) <= 4096 for plan in plans for mb in plan)
    assert len({len(plan) for plan in plans}) == 1
    tokens = rank_tokens(lengths, plans)
    assert max(tokens) / min(tokens) < 1.05  # 16 samples a rank: LPT is close
    with pytest.raises(ValueError, match="2049 tokens exceeds the budget of 2048"):
        plan_micro_batches([10, 2049], 2, 2048)


def _skewed_inputs(root, n=16):
    """A tiny HF Llama folder and replies of 2 to 40 words (about 12 to 90 tokens)."""
    folder = chat_tests.make_folder(root / "model", TEMPLATES["chatml"])
    models_hf.make_hf("llama").save_pretrained(folder)
    words = ["apples", "rivers", "tools", "seven", "the", "café"]
    rows = [{"messages": [{"role": "user", "content": f"user {i} asks"},
                          {"role": "assistant", "content": " ".join(words[(i + k) % 6]
                                                                   for k in range(2 + (i * 7) % 39))}]}
            for i in range(n)]  # fmt: skip
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def _one_step(folder, data, run_dir, *extra):
    """One SFT step on this rank: loss, full gradients, tokens-per-rank metrics."""
    from mindspeed_core.distributed import process_group
    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.sft_data import SFTData
    from mindspeed_llm.train.trainer import Trainer

    args = run_args(folder, data, run_dir, "--data.seq_len=128", "--data.mode=pad",
                    "--parallel.dp_shard=2", "--optim.clip_grad=0", "--train.global_batch=8",
                    *extra)  # fmt: skip
    cfg = load_config(SFTConfig, None, args)
    with process_group("cpu") as info:
        objective = NextToken(cfg.train.loss_normalization, supervised_logits_only=True)
        trainer = Trainer(cfg, info, data=SFTData, objective=objective, command="sft")
        micro_batches = trainer.data.next_step()
        result = trainer.step(micro_batches)
        grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for name, p in trainer.model.named_parameters()}  # fmt: skip
        widths = [b["input_ids"].shape for b in micro_batches]
        return float(result.loss), grads, dict(trainer.data.step_metrics), widths


def _fixed_and_budget(folder, data, root):
    # one sample for two ranks: rank 1 runs an empty micro-batch (FSDP's collectives pair up)
    out = {"lone": _one_step(folder, data, root / "lone", "--train.global_batch=1",
                             "--train.micro_batch_tokens=160")}  # fmt: skip
    for norm in ("token", "sample"):
        weighting = f"--train.loss_normalization={norm}"
        out[norm] = (_one_step(folder, data, root / f"fixed-{norm}", weighting, "--train.micro_batch=2"),
                     _one_step(folder, data, root / f"budget-{norm}", weighting,
                               "--train.micro_batch_tokens=160"))  # fmt: skip
    return out


def test_budget_gives_the_fixed_row_gradients_under_dp_shard(tmp_path):
    folder, data = _skewed_inputs(tmp_path)
    ranks = run_distributed(_fixed_and_budget, 2, folder, data, tmp_path, timeout=600)
    (loss, grads, metrics, shapes), (_, _, _, empty) = ranks[0]["lone"], ranks[1]["lone"]
    assert metrics["rank_tokens_min"] == 0 and len(shapes) == len(empty) == 1
    assert loss > 0 and all(bool(g.abs().sum() > 0) for g in grads.values() if g is not None)
    for norm in ("token", "sample"):
        fixed_run, budget_run = ranks[0][norm]
        (loss, grads, fixed_metrics, fixed_shapes), (b_loss, b_grads, metrics, shapes) = (
            fixed_run,
            budget_run,
        )
        assert b_loss == pytest.approx(loss, abs=1e-6), norm
        for name, grad in grads.items():
            torch.testing.assert_close(b_grads[name], grad, atol=1e-6, rtol=0, msg=f"{norm} {name}")
        # fixed rows: 2 micro-batches of 2 padded rows; the budget: single packed rows
        assert fixed_shapes[0][0] == 2 and all(s[0] == 1 and s[1] <= 160 for s in shapes)
        assert len(shapes) == len(ranks[1][norm][1][3])  # the same count on both ranks
        ratio = metrics["rank_tokens_max"] / metrics["rank_tokens_min"]
        fixed = fixed_metrics["rank_tokens_max"] / fixed_metrics["rank_tokens_min"]
        print(f"{norm}: max/min tokens per rank {fixed:.3f} fixed rows, {ratio:.3f} budget")
        assert ratio <= fixed and ratio < 1.1


def test_budget_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=0 must be positive"):
        TrainSection(micro_batch_tokens=0)
    folder, data = _skewed_inputs(tmp_path, n=4)
    cases = [
        (["--train.micro_batch_tokens=-5"], r"train.micro_batch_tokens=-5 must be positive"),
        (["--data.seq_len=128", "--train.micro_batch_tokens=20"],
         r"train.micro_batch_tokens=20 is below the longest sample \(\d+ tokens\)"),
        (["--train.micro_batch_tokens=128", "--parallel.pp=2"],
         r"train.micro_batch_tokens=128 needs parallel.pp=1"),
    ]  # fmt: skip
    capsys.readouterr()
    for extra, message in cases:
        run_dir = tmp_path / "run"
        assert guarded(main, run_args(folder, data, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[-1]), err
        assert not (run_dir / "metrics.jsonl").exists()
    # pretraining's samples are all seq_len tokens: refused before any data is read
    run_dir = tmp_path / "pretrain"
    args = ["--train.micro_batch_tokens=128", f"--logging.run_dir={run_dir}"]
    assert guarded(pretrain_main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"train.micro_batch_tokens=128: pretraining's samples are all", err), err
    assert not run_dir.exists()


def test_budget_validation_and_steps_equal_fixed_rows(tmp_path):
    """One process, two steps with validation after each: the budget's training and
    validation losses are fixed rows' (validation takes the same held-out samples a step at
    a time, packed by the budget)."""
    from mindspeed_core.training import read_metrics
    from mindspeed_llm.sft import sft

    folder, data = _skewed_inputs(tmp_path)
    common = ["--data.seq_len=128", "--data.mode=pad", "--data.valid_fraction=0.25",
              "--train.global_batch=4", "--train.micro_batch=2", "--train.steps=2",
              "--train.eval_interval=1", "--train.eval_batches=1"]  # fmt: skip
    runs = {}
    for name, extra in (("fixed", []), ("budget", ["--train.micro_batch_tokens=160"])):
        sft(load_config(SFTConfig, None, run_args(folder, data, tmp_path / name, *common, *extra)))
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    for a, b in zip(runs["fixed"], runs["budget"], strict=True):
        for key in ("loss", "valid_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert len(runs["budget"]) == 2 and runs["budget"][0]["rank_tokens_max"] > 0
