"""`mindspeed dpo` on a tiny Hugging Face Llama folder: the first step's loss and rewards are the
pure loss of log-probs computed by separate forwards, dp_shard=2 gives one process's losses, and
bad input is one line and exit status 2 with nothing written."""

import json
import re
from pathlib import Path

import pytest
import torch

from mindspeed_align.dpo import dpo, main
from mindspeed_align.dpo_config import DPOConfig
from mindspeed_align.losses import dpo_loss
from mindspeed_align.pairs import PairData
from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.data.sft_templates import TEMPLATES
from mindspeed_llm.train.trainer import Trainer

_LLM_TESTS = str(Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests" / "x.py")
chat_tests = import_sibling(_LLM_TESTS, "test_chat_template")
models_hf = import_sibling(_LLM_TESTS, "models_hf")
WORDS = ["apples", "rivers", "tools", "clouds"]


def make_inputs(root, n=8):
    """A tiny HF Llama folder (random weights, a ChatML tokenizer) and a pairs file."""
    folder = chat_tests.make_folder(root / "model", TEMPLATES["chatml"])
    models_hf.make_hf("llama").save_pretrained(folder)
    rows = [{"prompt": f"user {i} asks about {WORDS[i % 4]}", "chosen": f"the answer is {i * 7}",
             "rejected": "no idea" if i % 2 else f"maybe {i} or {i + 1}"} for i in range(n)]  # fmt: skip
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def run_args(folder, data, run_dir, *extra):
    return [f"--model.hf_path={folder}", f"--data.paths=[{data}]", "--data.seq_len=64",
            "--data.valid_fraction=0", "--model.ops_impl=reference", "--train.eval_interval=0",
            "--optim.warmup_steps=1", "--optim.lr=1e-3", "--logging.log_interval=1",
            "--logging.progress=false", "--logging.tensorboard=false", f"--logging.run_dir={run_dir}",
            *extra]  # fmt: skip


def _alone(model, ids, labels):
    """(log-prob sum, supervised tokens) of one sequence from its own forward."""
    ids, labels = torch.as_tensor(ids)[None], torch.as_tensor(labels)[None]
    logits = model(ids, position_ids=torch.arange(ids.shape[1])[None],
                   cu_seqlens=torch.tensor([0, ids.shape[1]], dtype=torch.int32))  # fmt: skip
    keep = labels[0] != -100
    logp = torch.log_softmax(logits.float(), -1)[0][keep].gather(-1, labels[0][keep][:, None]).sum()
    return logp, keep.sum()


def test_first_step_is_the_pure_loss_of_separate_forwards(tmp_path):
    folder, data = make_inputs(tmp_path)
    args = run_args(folder, data, tmp_path / "run", "--train.steps=2", "--train.micro_batch=4",
                    "--train.global_batch=8", "--dpo.loss=ipo", "--dpo.beta=0.5", "--dpo.pref_ftx=0.3", "--dpo.ref=model")  # fmt: skip
    cfg = load_config(DPOConfig, None, args)
    info = init_distributed(device_type="cpu")
    try:
        from mindspeed_align.dpo import PreferenceObjective

        objective = PreferenceObjective(cfg.dpo)
        trainer = Trainer(cfg, info, data=PairData, objective=objective, command="dpo")
        reference = objective.reference  # built by the objective's setup
        with torch.no_grad():  # a reference unlike the policy, so the rewards are not all zero
            for p in reference.parameters():
                p.mul_(0.9)
        micro_batches = trainer.data.next_step()
        pairs = [trainer.data._row(i) for i in range(8)]
        with torch.no_grad():
            pol = [_alone(trainer.model, *s) for p in pairs for s in p]
            ref = [_alone(reference, *s) for p in pairs for s in p]
        result = trainer.step(micro_batches)
    finally:
        destroy_distributed()
    logps, lengths = torch.stack([p[0] for p in pol]), torch.stack([p[1] for p in pol]).float()
    ref_logps = torch.stack([r[0] for r in ref])
    pure = dpo_loss(logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], beta=0.5, loss="ipo",
                    chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])  # fmt: skip
    expected = (pure.losses - 0.3 * logps[0::2] / lengths[0::2]).mean()
    assert result.loss == pytest.approx(float(expected), rel=1e-5)
    margins = pure.chosen_rewards - pure.rejected_rewards
    assert abs(float(margins.mean())) > 1e-3  # the check below is not about zeros
    for key, value in [("rewards/chosen", pure.chosen_rewards.mean()), ("rewards/margins", margins.mean()),
                       ("rewards/accuracies", (margins > 0).float().mean()), ("logps/rejected", logps[1::2].mean())]:  # fmt: skip
        # abs 1e-5: the separate forwards run under no_grad, where sequences of <= 64 tokens take
        # mindspeed-ops' few-row CPU GEMM (fp32, another summation order than the training
        # step's oneDNN GEMM); the margins, differences of log-prob sums, show it at ~1e-5 rel.
        assert result.metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-5), key


# TRL 1.16's DPOTrainer on the same folder and 8 pairs (bf16=False, beta=0.1): the first batch's
# metrics and the gradient norm of its loss, recorded so the comparison runs without TRL.
TRL_FIRST = {"loss": 0.6931471824645996, "logps/chosen": -66.13158416748047,
             "logps/rejected": -68.73853302001953, "grad_norm": 4.19710636138916}


def trl_first_step(folder, data):
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                           "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                           "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                          for r in rows])  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.pad_token = "<unk>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = trl.DPOConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=8, max_length=128,
                           beta=0.1, bf16=False, report_to=[], use_cpu=True, dataset_num_proc=None)  # fmt: skip
    trainer = trl.DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss), "logps/chosen": metrics["logps/chosen"],
            "logps/rejected": metrics["logps/rejected"], "grad_norm": float(norm)}  # fmt: skip


def test_first_step_equals_trl_dpo_trainer(tmp_path):
    """Loss, log-probs and the gradient norm of the first step (policy = reference, so the
    log-probs and the gradient are what can differ)."""
    folder, data = make_inputs(tmp_path)
    dpo(load_config(DPOConfig, None, run_args(folder, data, tmp_path / "run", "--train.steps=1",
        "--train.micro_batch=8", "--train.global_batch=8", "--data.seq_len=128")))  # fmt: skip
    ours = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    for key, value in TRL_FIRST.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key
    theirs = trl_first_step(folder, data)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key


def _dp_shard(folder, data, root):
    dpo(load_config(DPOConfig, None, run_args(folder, data, root / "dp", "--train.steps=3",
        "--train.micro_batch=2", "--train.global_batch=4", "--parallel.dp_shard=2")))  # fmt: skip
    return read_metrics(root / "dp" / "metrics.jsonl")


@pytest.mark.distributed
def test_dp_shard_equals_one_process(tmp_path):
    folder, data = make_inputs(tmp_path, n=12)
    dpo(load_config(DPOConfig, None, run_args(folder, data, tmp_path / "one", "--train.steps=3",
                                              "--train.micro_batch=4", "--train.global_batch=4")))  # fmt: skip
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert len(one) == 3 and one[-1]["loss"] < one[0]["loss"] and one[-1]["rewards/margins"] > 0
    dp = run_distributed(_dp_shard, 2, folder, data, tmp_path, timeout=600)[0]
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in dp], [m[key] for m in one], rtol=1e-5, atol=1e-6, msg=key)


def test_a_prompt_tokenised_differently_before_the_replies_is_refused(tmp_path, capsys, monkeypatch):
    """Segments are tokenised apart, so only a template that renders the prompt by the reply
    can do this; such a template is simulated here (one more prompt token before a long reply)."""
    import numpy as np

    import mindspeed_align.pairs as pairs

    real = pairs.encode_sample

    def reply_dependent(template, tokenizer, messages):
        ids, labels = real(template, tokenizer, messages)
        if len(messages[-1]["content"]) > 12:  # "the answer is 0" of line 1, not "maybe 0 or 1"
            ids, labels = np.concatenate([[5], ids]), np.concatenate([[-100], labels])
        return ids, labels

    monkeypatch.setattr(pairs, "encode_sample", reply_dependent)
    folder, data = make_inputs(tmp_path, n=2)
    assert guarded(main, run_args(folder, data, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"pairs.jsonl:1: the prompt's tokens differ before the chosen and the rejected", err), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _write_mmidx(prefix, rows):
    """A `.bin`/`.idx` pair written from MindSpeed-LLM's documented layout (Megatron's MMIDIDX
    v1, int32 tokens as MindSpeed-LLM keeps them), one document per row: not our writer."""
    import struct

    import numpy as np

    arrays = [np.asarray(r, dtype=np.int32) for r in rows]
    with open(f"{prefix}.bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes(order="C"))
    lengths = np.asarray([len(a) for a in arrays], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 4)]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))  # dtype 4: int32
        f.write(struct.pack("<Q", len(arrays)) + struct.pack("<Q", len(arrays) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(arrays) + 1, dtype=np.int64).tobytes())


def test_mindspeed_llm_pairwise_prefixes_train_as_the_jsonl_does(tmp_path):
    """MindSpeed-LLM's pairwise outputs (`{prefix}_packed_{chosen,rejected}_{input_ids,labels}
    _document`, labels aligned with the ids and -100 on the prompt), written by the layout above,
    give the jsonl pairs' losses; `mindspeed preprocess --handler-name pairwise` writes the same
    bytes."""
    import json as json_

    from mindspeed_llm.chat_template import load_chat_template
    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_tools.preprocess import command as preprocess

    folder, data = make_inputs(tmp_path)
    template, tok = load_chat_template(folder), load_tokenizer(folder)
    from mindspeed_align.pairs import encode_pair

    pairs = [encode_pair(template, tok, json_.loads(line), "x") for line in data.read_text().splitlines()]
    prefix = tmp_path / "theirs" / "pairs"
    prefix.parent.mkdir()
    for side, k in (("chosen", 0), ("rejected", 1)):
        _write_mmidx(f"{prefix}_packed_{side}_input_ids_document", [p[k][0] for p in pairs])
        unshifted = [[-100] + list(p[k][1][:-1]) for p in pairs]  # theirs: aligned with the ids
        _write_mmidx(f"{prefix}_packed_{side}_labels_document", unshifted)
    from_jsonl = _losses(folder, data, tmp_path / "jsonl")
    from_prefix = _losses(folder, prefix, tmp_path / "prefix")
    assert [m["loss"] for m in from_prefix] == [m["loss"] for m in from_jsonl]
    ours = tmp_path / "ours" / "pairs"
    assert preprocess.run(["--input", str(data), "--output-prefix", str(ours), "--handler-name",
                           "AlpacaStylePairwiseHandler", "--tokenizer-name-or-path", str(folder)]) == 0  # fmt: skip
    for name in sorted(p.name for p in prefix.parent.iterdir()):
        assert (ours.parent / name).read_bytes() == (prefix.parent / name).read_bytes(), name


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    folder, data = make_inputs(tmp_path, n=2)
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}) + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xb0")  # a zip, say
    cases = [
        ([], binary, r"binary.jsonl:1: not UTF-8 text \(byte 0xb0 at column 11\)"),
        ([], tmp_path / "missing.jsonl", r"does not exist: .*missing.jsonl"),
        ([], same, r"same.jsonl:1: chosen and rejected are the same reply"),
        (["--dpo.ref=none"], data, r"dpo.ref=none: dpo.loss=sigmoid needs a reference model"),
        (["--dpo.ref=model", "--parallel.pp=2"], data, r"dpo.ref=model with parallel.pp=2: .*precomputed"),
        (["--dpo.shared_prompts=maybe"], data, r"dpo.shared_prompts"),
    ]
    capsys.readouterr()
    for extra, path, message in cases:
        run_dir = tmp_path / "run"
        assert guarded(main, run_args(folder, path, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[-1]), err
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_embedded_demo_reaches_the_accuracy_goal(tmp_path, monkeypatch):
    """`mindspeed dpo` with no arguments: SFT warm start, then DPO on the generated pairs."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    cfg = load_config(DPOConfig, None, [f"--logging.run_dir={tmp_path / 'run'}", "--logging.progress=false"])
    summary = dpo(cfg)
    assert summary["reward_accuracy_before"] == 0.0  # the policy is the reference: every reward 0
    assert summary["reward_accuracy_after"] > 0.9
    # the policy still prefers the right answers (0.99 before; 0.945 after since S2's per-name
    # init: the 6% of pairs whose margin DPO moved the wrong way partly cross over)
    assert summary["policy_preference_after"] > 0.9 and summary["policy_preference_before"] > 0.9


def _losses(folder, data, run_dir, *extra):
    dpo(load_config(DPOConfig, None, run_args(folder, data, run_dir, "--train.steps=3", "--train.micro_batch=4",
                                              "--train.global_batch=4", *extra)))  # fmt: skip
    return read_metrics(run_dir / "metrics.jsonl")


def test_replies_only_logits_equal_every_position(tmp_path, monkeypatch):
    """The policy and the reference project the replies' positions alone (A3 item 2): three
    steps give the losses, rewards and gradient norms of projecting every position, while
    the output layer sees fewer rows."""
    from mindspeed_align.dpo import PreferenceObjective
    from mindspeed_llm.models.common.transformer import Transformer

    folder, data = make_inputs(tmp_path)
    rows = []
    project = Transformer.project
    monkeypatch.setattr(Transformer, "project", lambda self, h: rows.append(h.numel() // h.shape[-1]) or project(self, h))
    cut = _losses(folder, data, tmp_path / "cut", "--dpo.ref=model")
    cut_rows, rows[:] = list(rows), []
    monkeypatch.setattr(PreferenceObjective, "supervised_logits_only", False)
    monkeypatch.setattr(PreferenceObjective, "setup", _every_position(PreferenceObjective.setup))
    full = _losses(folder, data, tmp_path / "full", "--dpo.ref=model")
    assert cut_rows and sum(cut_rows) < sum(rows) / 2  # prompts and padding left out
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in cut], [m[key] for m in full], rtol=1e-5, atol=1e-6, msg=key)


def test_the_fused_linear_cross_entropy_gives_the_same_steps(tmp_path, monkeypatch):
    """`train.fused_linear_cross_entropy: on`: the policy's log-probs from the fused op,
    no logits made (the output layer never runs for the policy); the same three steps."""
    from mindspeed_llm.models.common.transformer import Transformer

    folder, data = make_inputs(tmp_path)
    plain = _losses(folder, data, tmp_path / "plain", "--dpo.ref=precompute")
    monkeypatch.setattr(Transformer, "project", lambda self, h: pytest.fail("logits were made"))
    fused = _losses(folder, data, tmp_path / "fused", "--dpo.ref=precompute",
                    "--train.fused_linear_cross_entropy=on")  # fmt: skip
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in fused], [m[key] for m in plain], rtol=1e-5, atol=1e-6, msg=key)


def _every_position(setup):
    def every_position(self, run):
        setup(self, run)
        self.reference_keep = False

    return every_position


def test_lora_reference_is_the_base_with_adapters_off(tmp_path, monkeypatch):
    """LoRA-DPO's default reference is the policy with its adapters bypassed (no second model
    is built), and scores as a frozen copy of the base does: after the adapters have moved,
    three steps give the losses and rewards of `ref: model` (1e-6)."""
    folder, data = make_inputs(tmp_path)
    lora = ("--lora.rank=4", "--lora.alpha=8", "--optim.lr=1e-2")
    copy = _losses(folder, data, tmp_path / "copy", *lora, "--dpo.ref=model")
    built, build_model = [], Trainer.build_model

    def counting(self, **options):
        built.extend([1] if options.get("frozen") else [])
        return build_model(self, **options)

    monkeypatch.setattr(Trainer, "build_model", counting)
    off = _losses(folder, data, tmp_path / "off", *lora)
    assert built == []  # no frozen copy
    assert abs(off[-1]["rewards/margins"]) > 1e-3  # the adapters moved the policy away
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in off], [m[key] for m in copy], rtol=1e-6, atol=1e-6, msg=key)


def test_precomputed_reference_equals_the_model_and_is_reused(tmp_path, monkeypatch):
    """`dpo.ref: auto` precomputes once the steps read every pair (a shorter run keeps a
    model); the values equal the model's, are cached, reused, and rebuilt when unusable."""
    import mindspeed_align.reference as reference

    folder, data = make_inputs(tmp_path)
    cache = f"--data.cache_dir={tmp_path / 'cache'}"
    model = _losses(folder, data, tmp_path / "model", cache, "--dpo.ref=model")
    _losses(folder, data, tmp_path / "short", cache, "--train.steps=1")  # auto: 4 of 8 pairs read
    assert not list((tmp_path / "cache").glob("ref-*.pt"))  # neither precomputed
    first = _losses(folder, data, tmp_path / "pre", cache)  # auto: 3 x 4 pairs read, precomputed
    files = list((tmp_path / "cache").glob("ref-*.pt"))
    assert len(files) == 1 and not list((tmp_path / "cache").glob(".ref-*"))  # no temporary left
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected", "grad_norm"):
        torch.testing.assert_close([m[key] for m in first], [m[key] for m in model], rtol=1e-6, atol=1e-6, msg=key)

    def no_forward(*args, **kwargs):
        raise AssertionError("the cached reference log-probs were computed again")

    monkeypatch.setattr(reference, "_compute", no_forward)
    again = _losses(folder, data, tmp_path / "again", cache, "--dpo.ref=precompute")
    assert [m["loss"] for m in again] == [m["loss"] for m in first]
    monkeypatch.undo()
    # A cache that cannot be used is computed again, with one warning: truncated, or hostile
    # (a pickle that would run a command; weights_only refuses it, nothing runs).
    from mindspeed_core.testing.hostile import plant_hostile_torch_file

    marker = tmp_path / "ran"
    for name, plant in (("truncated", lambda f: f.write_bytes(f.read_bytes()[:100])),
                        ("hostile", lambda f: plant_hostile_torch_file(f, marker))):  # fmt: skip
        plant(files[0])
        rebuilt = _losses(folder, data, tmp_path / name, cache, "--dpo.ref=precompute")
        assert [m["loss"] for m in rebuilt] == [m["loss"] for m in first], name
        assert torch.load(files[0], weights_only=True)["version"] == reference.CACHE_VERSION
    assert not marker.exists()


def _tp2(folder, data, root):
    plain = _losses(folder, data, root / "tp", "--parallel.tp=2")
    lora = _losses(folder, data, root / "tp_lora", "--parallel.tp=2", "--lora.rank=4", "--optim.lr=1e-2")
    return plain, lora


@pytest.mark.distributed
def test_tp2_equals_one_process_with_and_without_lora(tmp_path):
    folder, data = make_inputs(tmp_path)
    one = _losses(folder, data, tmp_path / "one")
    one_lora = _losses(folder, data, tmp_path / "one_lora", "--lora.rank=4", "--optim.lr=1e-2")
    tp, tp_lora = run_distributed(_tp2, 2, folder, data, tmp_path, timeout=600)[0]
    for got, want in ((tp, one), (tp_lora, one_lora)):
        for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
            torch.testing.assert_close([m[key] for m in got], [m[key] for m in want], rtol=1e-4, atol=1e-6, msg=key)
    assert abs(one_lora[-1]["rewards/margins"]) > 1e-3


def _pp2(folder, data, root, cache, *extra):
    return _losses(folder, data, root / "pp", "--parallel.pp=2", "--train.micro_batch=2", cache, *extra)


@pytest.mark.distributed
def test_pp2_equals_one_process(tmp_path):
    """Under pipeline parallel the reference log-probs are precomputed by the whole starting
    model; each micro-batch is `train.micro_batch` rows, pairs numbered across the step."""
    folder, data = make_inputs(tmp_path)
    cache = f"--data.cache_dir={tmp_path / 'cache'}"
    one = _losses(folder, data, tmp_path / "one", "--train.micro_batch=2")
    pp = run_distributed(_pp2, 2, folder, data, tmp_path, cache, timeout=600)[0]
    assert abs(one[-1]["rewards/margins"]) > 1e-3
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in pp], [m[key] for m in one], rtol=1e-4, atol=1e-6, msg=key)


def _cp2(folder, data, root, cache, *extra):
    return _losses(folder, data, root / "cp", "--parallel.cp=2", cache, *extra)


@pytest.mark.distributed
def test_cp2_equals_one_process(tmp_path):
    """Each context-parallel rank sums its share of every sequence's log-probs; the loss adds
    the shares over the cp ranks (the reference is precomputed, whole)."""
    folder, data = make_inputs(tmp_path)
    cache = f"--data.cache_dir={tmp_path / 'cache'}"
    one = _losses(folder, data, tmp_path / "one")
    cp = run_distributed(_cp2, 2, folder, data, tmp_path, cache, timeout=600)[0]
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
        torch.testing.assert_close([m[key] for m in cp], [m[key] for m in one], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_dpo_under_dp_shard_pp_and_cp_equals_one_process(tmp_path):
    folder, data = make_inputs(tmp_path, n=12)
    cache, lora = f"--data.cache_dir={tmp_path / 'cache'}", ("--lora.rank=4", "--optim.lr=1e-2")
    one = _losses(folder, data, tmp_path / "one", "--train.micro_batch=2", *lora)
    runs = {
        "dp_shard": run_distributed(_dp_shard_lora, 2, folder, data, tmp_path, lora, timeout=600)[0],
        "pp": run_distributed(_pp2, 2, folder, data, tmp_path, cache, *lora, timeout=600)[0],
        "cp": run_distributed(_cp2, 2, folder, data, tmp_path, cache, "--train.micro_batch=2", *lora,
                              timeout=600)[0],
    }  # fmt: skip
    assert abs(one[-1]["rewards/margins"]) > 1e-3
    for name, got in runs.items():
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            torch.testing.assert_close([m[key] for m in got], [m[key] for m in one], rtol=1e-4, atol=1e-6,
                                       msg=f"{name} {key}")  # fmt: skip


def _dp_shard_lora(folder, data, root, lora):
    return _losses(folder, data, root / "dp_lora", "--parallel.dp_shard=2", "--train.micro_batch=2", *lora)


@pytest.mark.slow
def test_a_full_disk_during_a_lora_save_is_one_line_and_the_run_resumes(tmp_path, capsys):
    """The adapters' checkpoint on a full disk: one line, exit 2, step 2 kept, the rerun resumes."""
    from mindspeed_core.testing.faults import check_full_disk_resumes

    folder, data = make_inputs(tmp_path, n=4)
    run_dir = tmp_path / "run"
    args = run_args(folder, data, run_dir, "--lora.rank=4", "--checkpoint.interval=2",
                    "--train.steps=4", "--train.micro_batch=2", "--train.global_batch=2")  # fmt: skip
    check_full_disk_resumes(main, args, run_dir, capsys, steps=4)
