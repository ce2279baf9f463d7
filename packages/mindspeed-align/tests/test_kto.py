"""`mindspeed kto` on a tiny Hugging Face Llama folder: the first step equals TRL's KTOTrainer
(loss, KL estimate, rewards, log-probs, gradient norm), bad input is one line and exit 2."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from mindspeed_align.kto import KTOConfig, KTOObjective, kto, main
from mindspeed_align.kto_data import KTOData, encode_example, load_examples
from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.train.trainer import Trainer

test_dpo = import_sibling(__file__, "test_dpo")
WORDS = ["apples", "rivers", "tools", "clouds"]
REF_SCALE = 1.2
"""The reference is the starting model with every parameter scaled by this (so the rewards and
the KL estimate are not all zero)."""


def make_inputs(root, n=8):
    """A tiny HF Llama folder (random weights, a ChatML tokenizer) and an unpaired file."""
    folder, _ = test_dpo.make_inputs(root, n=2)
    rows = [{"prompt": f"user {i} asks about {WORDS[i % 4]}",
             "completion": f"the answer is {i * 7}" if i % 3 else f"maybe {i} or {i + 1}",
             "label": bool(i % 3)} for i in range(n)]  # fmt: skip
    data = root / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def first_step(folder, data, root):
    """Our first step (micro-batch = global batch = 8) with a scaled reference, and the order
    of the records in it."""
    args = test_dpo.run_args(folder, data, root / "run", "--train.steps=1", "--train.micro_batch=8",
                             "--train.global_batch=8", "--data.seq_len=256")  # fmt: skip
    cfg = load_config(KTOConfig, None, args)
    info = init_distributed(device_type="cpu")
    try:
        objective = KTOObjective(cfg.kto)
        trainer = Trainer(cfg, info, data=KTOData, objective=objective, command="kto")
        with torch.no_grad():  # the reference the objective's setup built, scaled
            for p in objective.reference.parameters():
                p.mul_(REF_SCALE)
        records = [json.loads(line) for line in data.read_text().splitlines()]
        encoded = [
            encode_example(trainer.data.template, trainer.data.tokenizer, r, "x")[0][0]
            for r in records
        ]
        order = []
        for i in range(8):
            ids = trainer.data._row(i)[0][0]
            order.append(
                next(j for j, e in enumerate(encoded) if len(e) == len(ids) and (e == ids).all())
            )
        result = trainer.step(trainer.data.next_step())
    finally:
        destroy_distributed()
    return result, [records[j] for j in order]


def trl_first_step(folder, records):
    """TRL's KTOTrainer on the same folder and records (in our order), reference scaled too."""
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                           "completion": [{"role": "assistant", "content": r["completion"]}],
                                           "label": r["label"]} for r in records])  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.pad_token = "<unk>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(REF_SCALE)
    config = trl.KTOConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=8, max_length=256,
                           beta=0.1, bf16=False, report_to=[], use_cpu=True, dataset_num_proc=None)  # fmt: skip
    trainer = trl.KTOTrainer(
        model=model, ref_model=ref, args=config, train_dataset=dataset, processing_class=tok
    )
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    norm = torch.sqrt(
        sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)
    )
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    keys = (
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    return {"loss": float(loss), **{k: metrics[k] for k in keys}, "grad_norm": float(norm)}


# TRL 1.16's KTOTrainer on the same folder and records (written so the test runs without trl).
TRL_FIRST = {
    "loss": 0.5291480422019958,
    "kl": 4.736023902893066,
    "rewards/chosen": 0.3576852560043335,
    "rewards/rejected": 0.5919235547383627,
    "rewards/margins": -0.23423829873402918,
    "logps/chosen": -66.2673095703125,
    "logps/rejected": -77.79762776692708,
    "grad_norm": 1.369730830192566,
}


def test_first_step_equals_trl_kto_trainer(tmp_path):
    folder, data = make_inputs(tmp_path)
    result, records = first_step(folder, data, tmp_path)
    ours = {"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics}
    assert ours["kl"] > 0 and ours["count/chosen"] + ours["count/rejected"] == 8
    for key, value in TRL_FIRST.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key
    theirs = trl_first_step(folder, records)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def _objective_on_rank():
    """This rank's KTO loss on its own random micro-batch, the KL averaged over both ranks."""
    import numpy as np
    import torch.distributed as dist

    from mindspeed_align.kto import KTOSection
    from mindspeed_align.kto_data import kto_batch
    from mindspeed_align.logps import SLOT_KEY, sequence_logps
    from mindspeed_llm.train.objectives import LossContext

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    samples = []
    for i in range(4):  # 3 prompt tokens, 2 + i completion tokens
        ids = torch.randint(0, 16, (5 + i,), generator=gen).numpy()
        samples.append(((ids, np.array([-100, -100, *ids[3:], -100])), i % 2 == rank))
    batch = kto_batch(samples, 32, 0)
    logits = torch.randn(*batch["input_ids"].shape, 16, generator=gen)
    num_slots = int(batch[SLOT_KEY].max()) + 1
    logps = sequence_logps(logits, batch["labels"], batch[SLOT_KEY], num_slots)[0]
    ref = logps - 1 - torch.randn(num_slots, generator=gen)  # log-ratios about 1: z > 0
    objective = KTOObjective(KTOSection(beta=0.5), kl_group=dist.group.WORLD)
    targets = {
        "labels": batch["labels"],
        SLOT_KEY: batch[SLOT_KEY],
        "num_slots": torch.tensor(num_slots),
        "ref_logps": ref,
        "kto_label": batch["kto_label"],
    }
    out = objective.loss(logits, targets, LossContext())
    return logps, ref, batch["kto_label"], float(out.loss_sum), float(out.metrics["kl"])


@pytest.mark.distributed
def test_kl_estimate_is_averaged_over_data_parallel_ranks():
    """Two ranks with different micro-batches: each rank's loss uses z = max(0, mean of the two
    ranks' own mismatched log-ratio means), as TRL gathers it."""
    from mindspeed_align.losses import kto_loss

    ranks = run_distributed(_objective_on_rank, 2, timeout=300)
    local = [float((logps[1::2] - ref[1::2]).mean()) for logps, ref, *_ in ranks]
    z = max(0.0, sum(local) / 2)
    assert z > 0 and local[0] != pytest.approx(local[1])  # averaging changes something
    for logps, ref, labels, loss_sum, kl_sum in ranks:
        expected = kto_loss(logps[0::2], ref[0::2], labels, torch.tensor(z), beta=0.5).losses.sum()
        assert loss_sum == pytest.approx(float(expected), rel=1e-6)
        assert kl_sum == pytest.approx(4 * z, rel=1e-6)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    folder, _ = make_inputs(tmp_path, n=2)
    one_class = tmp_path / "liked.jsonl"
    one_class.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "a", "label": True}) + "\n"
                                 for i in range(3)))  # fmt: skip
    bad_label = tmp_path / "bad_label.jsonl"
    bad_label.write_text(json.dumps({"prompt": "q", "completion": "a", "label": "yes"}) + "\n")
    cases = [
        (
            [],
            one_class,
            r"liked.jsonl: every example is labelled True; KTO needs desirable .* and undesirable",
        ),
        (
            [],
            bad_label,
            r"bad_label.jsonl:1: key 'label' \(or 'kto_tag'\) must be true or false, got 'yes'",
        ),
        (["--train.micro_batch=1"], one_class, r"kto: train.micro_batch=1: the KL estimate"),
    ]
    capsys.readouterr()
    for extra, path, message in cases:
        run_dir = tmp_path / "run"
        assert guarded(main, test_dpo.run_args(folder, path, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[-1]), err
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_preprocess_kto_prefix_reads_as_the_raw_file(tmp_path):
    """`mindspeed preprocess --handler-name kto` (TRL's and alpaca/LLaMA-Factory spellings) gives
    the examples and labels the raw file gives; a record without a label is skipped."""
    from mindspeed_llm.data.sft_templates import resolve_template
    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_tools.preprocess import parse_args
    from mindspeed_tools.preprocess.run import preprocess

    folder, _ = make_inputs(tmp_path, n=2)
    rows = [{"prompt": "p0", "completion": "yes", "label": True},
            {"instruction": "p1", "input": "more", "output": "no", "kto_tag": False},
            {"prompt": [{"role": "user", "content": "p2"}], "completion": [{"role": "assistant", "content": "x"}],
             "label": True}]  # fmt: skip
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = tmp_path / "with_bad.jsonl"
    bad.write_text(raw.read_text() + json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    args = [
        "--input",
        bad,
        "--tokenizer",
        folder,
        "--handler-name",
        "kto",
        "--output-prefix",
        tmp_path / "o" / "k",
    ]
    summary = preprocess(parse_args([*map(str, args), "--no-progress"]))
    assert (summary.documents, summary.skipped) == (3, 1)
    with pytest.raises(ConfigError, match="--pack needs --seq-length and an instruction handler"):
        parse_args(
            [*map(str, args), "--pack", "--seq-length", "64"]
        )  # one label per row: no packing
    tokenizer = load_tokenizer(folder)
    template = resolve_template(None, folder)
    data = SimpleNamespace(seq_len=256)
    from_raw, _ = load_examples(
        SimpleNamespace(paths=[str(raw)], **vars(data)), template, tokenizer
    )
    from_prefix, _ = load_examples(SimpleNamespace(paths=[str(tmp_path / "o" / "k")], **vars(data)), template,
                                   tokenizer)  # fmt: skip
    assert [d for _, d in from_prefix] == [True, False, True] == [d for _, d in from_raw]
    for (a, _), (b, _) in zip(from_raw, from_prefix, strict=True):
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all()


def _kto_run(folder, data, run_dir, *extra):
    kto(load_config(KTOConfig, None, test_dpo.run_args(folder, data, run_dir, "--train.steps=3",
        "--train.micro_batch=4", "--train.global_batch=4", "--data.seq_len=256", *extra)))  # fmt: skip
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_equals_one_process(tmp_path):
    """Vocabulary-parallel log-probs (tp=2, loss parallel) give one process's KTO steps."""
    folder, data = make_inputs(tmp_path, n=12)
    one = _kto_run(folder, data, tmp_path / "one")
    tp = run_distributed(
        _kto_run, 2, folder, data, tmp_path / "tp", "--parallel.tp=2", timeout=600
    )[0]
    assert len(one) == 3 and abs(one[-1]["rewards/margins"]) > 0
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
        torch.testing.assert_close(
            [m[key] for m in tp], [m[key] for m in one], rtol=1e-4, atol=1e-6, msg=key
        )


@pytest.mark.slow
def test_embedded_demo_accuracy_rises(tmp_path, monkeypatch):
    """`mindspeed kto` with no arguments: SFT warm start, then KTO on the unpaired demo."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    summary = kto(load_config(KTOConfig, None, [f"--logging.run_dir={tmp_path / 'run'}",
                                                "--logging.progress=false"]))  # fmt: skip
    assert summary["reward_accuracy_before"] == 0.0  # the policy is the reference: every reward 0
    assert summary["reward_accuracy_after"] > 0.9
