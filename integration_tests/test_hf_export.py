"""`logging.hf_export_every`: a run writes Hugging Face folders of its checkpoints at that
interval, which transformers loads with the checkpoint's own logits; an interval that does not
fall on checkpoints is one line, exit 2."""

from __future__ import annotations

import torch


def test_exports_at_the_interval_load_in_transformers(pretrain_cli, tmp_path):
    import transformers

    from mindspeed_llm.loading import load_model

    run = tmp_path / "run"
    done = pretrain_cli(run, "--checkpoint.interval=10", "--logging.hf_export_every=10")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_10", "step_20"]
    ours, config = load_model(run / "checkpoints" / "step_20")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(run / "hf" / "step_20",
                                                               attn_implementation="eager")  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(ids).logits, ours(ids), atol=1e-5, rtol=0)
    early = transformers.AutoModelForCausalLM.from_pretrained(run / "hf" / "step_10")
    assert not torch.equal(early.lm_head.weight, theirs.lm_head.weight)  # another step's weights


def test_an_interval_off_the_checkpoints_is_one_line(pretrain_cli, tmp_path):
    done = pretrain_cli(tmp_path / "run", "--checkpoint.interval=10", "--logging.hf_export_every=7")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: logging.hf_export_every=7 must be a positive multiple of checkpoint.interval=10 "
        "(it exports those checkpoints)"
    ]
    assert not (tmp_path / "run").exists()
