"""`mindspeed prm`: golden step-label positions of a hand-built record, the first step equal to
transformers' token classifier loss on the same weights and rows, bad input one line, exit 2."""

import json
import re

import pytest
import torch

from mindspeed_align.prm import PRMConfig, StepObjective, main, prm
from mindspeed_align.prm_data import PRMData
from mindspeed_align.reward import add_score_head, export_classifier, full_state_dict
from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.data.sft import encode_steps
from mindspeed_llm.data.sft_records import stepwise_record
from mindspeed_llm.train.trainer import Trainer
from mindspeed_tools.preprocess.handlers import Handler

test_dpo = import_sibling(__file__, "test_dpo")


class WordTokenizer:
    """Whitespace words -> ids in order of first use; BOS is 1."""

    bos_id = 1

    def __init__(self):
        self.vocab = {}

    def encode(self, text, add_bos=False):
        return [self.vocab.setdefault(w, len(self.vocab) + 2) for w in text.split()]


RECORD = {
    "prompt": "what is 1 + 2 + 3 ?",
    "completions": ["1 + 2 = 3", "3 + 3 = 7"],
    "labels": [True, False],
}


def test_golden_step_label_positions():
    """BOS, 8 prompt words, then "1 + 2 = 3 ки" (label at the separator, position 14) and
    "3 + 3 = 7 ки" (position 20); -100 everywhere else. The preprocess handler agrees."""
    tok = WordTokenizer()
    ids, labels = encode_steps(tok, *stepwise_record(RECORD), separator=" ки")
    words = "what is 1 + 2 + 3 ? 1 + 2 = 3 ки 3 + 3 = 7 ки".split()  # noqa: SIM905
    assert ids.tolist() == [1] + [tok.vocab[w] for w in words] and len(ids) == 21
    assert ids[14] == ids[20] == tok.vocab["ки"]
    assert {i: int(v) for i, v in enumerate(labels) if v != -100} == {14: 1, 20: 0}
    out = Handler("prm", tok, map_keys={"step_separator": " ки"})(RECORD)
    assert out["input_ids"] == ids.tolist() and out["labels"] == labels.tolist()
    # TRL's spelling `completions` or `steps`; a label per step
    assert (
        stepwise_record({**RECORD, "steps": RECORD["completions"], "completions": None})[1]
        == RECORD["completions"]
    )


def make_inputs(root, n=4):
    folder, _ = test_dpo.make_inputs(root, n=2)
    rows = [{"prompt": f"user {i} adds {i} and {i + 1}",
             "completions": [f"{i} plus {i + 1}", f"is {2 * i + 1 + i % 2}", "done"],
             "labels": [True, i % 2 == 0, i % 3 == 0]} for i in range(n)]  # fmt: skip
    data = root / "steps.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def test_first_step_equals_hf_token_classifier(tmp_path):
    """Loss (cross entropy at the step ends, mean over every labelled step of the step) and
    gradient norm equal transformers' LlamaForTokenClassification with the same weights; the
    trained model exported as *ForTokenClassification gives our logits in transformers."""
    import transformers

    folder, data = make_inputs(tmp_path)
    args = test_dpo.run_args(folder, data, tmp_path / "run", "--train.steps=1", "--train.micro_batch=2",
                             "--train.global_batch=4", "--data.mode=pad")  # fmt: skip
    cfg = load_config(PRMConfig, None, args)
    info = init_distributed(device_type="cpu")
    try:
        head = lambda model, dims=None: add_score_head(model, dims, num_outputs=2)  # noqa: E731
        trainer = Trainer(
            cfg, info, data=PRMData, objective=StepObjective(), before_tp=head, command="prm"
        )
        score = trainer.model.output.weight.detach().clone()
        samples = [s for (s,) in trainer.data.rows]
        result = trainer.step(trainer.data.next_step())
        exported = export_classifier(full_state_dict(trainer.model), trainer.model_cfg, tmp_path / "hf",
                                     pad_token_id=trainer.data.pad_id, tokenizer=folder, task="token")  # fmt: skip
        x = torch.as_tensor(samples[0][0])[None]
        with torch.no_grad():
            trained = trainer.model(x, position_ids=torch.arange(x.shape[1])[None],
                                    cu_seqlens=torch.tensor([0, x.shape[1]], dtype=torch.int32))  # fmt: skip
    finally:
        destroy_distributed()
    loaded = transformers.AutoModelForTokenClassification.from_pretrained(
        str(exported), dtype=torch.float32
    )
    torch.testing.assert_close(loaded.eval()(input_ids=x).logits, trained, rtol=1e-5, atol=1e-5)
    config = transformers.AutoConfig.from_pretrained(str(folder), num_labels=2)
    config.token_classification_bias = False  # our head has no bias
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        str(folder), config=config, dtype=torch.float32
    )
    hf.score.weight.data.copy_(score)
    hf.eval()  # no dropout; gradients still flow
    width = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, (x, y) in enumerate(samples):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = (
            torch.as_tensor(x),
            torch.as_tensor(y),
            1,
        )
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in hf.parameters() if p.grad is not None))
    assert int((labels != -100).sum()) == 12 and result.num_units == 12
    assert result.loss == pytest.approx(float(out.loss), rel=1e-5)
    assert result.grad_norm == pytest.approx(float(norm), rel=1e-4)
    correct = (out.logits.argmax(-1) == labels)[labels != -100].float().mean()
    assert result.metrics["accuracy"] == pytest.approx(float(correct), abs=1e-6)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    folder, _ = make_inputs(tmp_path, n=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**RECORD, "labels": [True]}) + "\n")
    capsys.readouterr()
    assert guarded(main, test_dpo.run_args(folder, bad, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and re.search(r"bad.jsonl:1: key 'labels' must hold one true/false per step \(2\)",
                                                err.splitlines()[-1]), err  # fmt: skip
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _prm_run(folder, data, run_dir, *extra):
    prm(load_config(PRMConfig, None, test_dpo.run_args(folder, data, run_dir, "--train.steps=3",
        "--train.micro_batch=2", "--train.global_batch=4", *extra)))  # fmt: skip
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_and_dp2_equal_one_process(tmp_path):
    """The two-output head kept whole under tp=2; dp_shard=2 divides by every rank's steps."""
    folder, data = make_inputs(tmp_path, n=8)
    one = _prm_run(folder, data, tmp_path / "one")
    tp = run_distributed(
        _prm_run, 2, folder, data, tmp_path / "tp", "--parallel.tp=2", timeout=600
    )[0]
    dp = run_distributed(
        _prm_run, 2, folder, data, tmp_path / "dp", "--parallel.dp_shard=2", timeout=600
    )[0]
    assert len(one) == 3 and one[-1]["loss"] < one[0]["loss"]
    for other in (tp, dp):
        for key in ("loss", "accuracy", "grad_norm"):
            torch.testing.assert_close([m[key] for m in other], [m[key] for m in one], rtol=1e-4, atol=1e-6,
                                       msg=key)  # fmt: skip


@pytest.mark.slow
def test_embedded_demo_step_accuracy_rises(tmp_path, monkeypatch):
    """`mindspeed prm` with no arguments: SFT warm start, then the PRM on generated steps."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    summary = prm(load_config(PRMConfig, None, [f"--logging.run_dir={tmp_path / 'run'}",
                                                "--logging.progress=false"]))  # fmt: skip
    assert summary["step_accuracy_after"] > 0.9 > summary["step_accuracy_before"]
