"""`mindspeed sft` end to end on a tiny Hugging Face Llama folder: its first loss equals
TRL's SFTTrainer completion-only loss, packed SFT under dp_shard=2 and tp=2 gives one
process's losses, and bad input is one line and exit status 2 with nothing written."""

import json
import re

import pytest
import torch

from mindspeed_core.cli import guarded
from mindspeed_core.config import load_config
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_core.training import read_metrics
from mindspeed_llm.data.sft_templates import TEMPLATES
from mindspeed_llm.sft import main, sft
from mindspeed_llm.train.sft_config import SFTConfig

chat_tests = import_sibling(__file__, "test_chat_template")
models_hf = import_sibling(__file__, "models_hf")

# TRL 1.16's SFTTrainer.compute_loss on the first batch (all 8 samples), recorded here
# so the comparison runs without TRL installed.
TRL_FIRST_LOSS = 6.385483264923096
QUESTIONS = [(f"user {i} asks about {w}", f"the café answers {i * 7}")
             for i in range(6) for w in ("apples", "rivers", "tools")]  # fmt: skip


def make_run_inputs(root, n=8):
    """A tiny HF Llama folder (random weights, a ChatML tokenizer) and a messages file."""
    folder = chat_tests.make_folder(root / "model", TEMPLATES["chatml"])
    models_hf.make_hf("llama").save_pretrained(folder)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in QUESTIONS[:n]]  # fmt: skip
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def run_args(folder, data, run_dir, *extra):
    return [f"--model.hf_path={folder}", f"--data.paths=[{data}]", "--data.seq_len=64",
            "--data.valid_fraction=0", f"--data.cache_dir={run_dir}/cache",  # handler: auto (messages)
            "--model.ops_impl=reference", "--train.eval_interval=0", "--optim.warmup_steps=1",
            "--logging.log_interval=1", "--logging.progress=false",
            "--logging.tensorboard=false", f"--logging.run_dir={run_dir}", *extra]  # fmt: skip


def first_sft_loss(folder, data, run_dir):
    """Our first step's loss: every sample in one padded batch, fp32."""
    args = run_args(folder, data, run_dir, "--data.mode=pad", "--train.steps=1",
                    "--train.micro_batch=8", "--train.global_batch=8")  # fmt: skip
    sft(load_config(SFTConfig, None, args))
    return read_metrics(run_dir / "metrics.jsonl")[0]["loss"]


def trl_first_loss(folder, data):
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    rows = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": m[:1], "completion": m[1:]} for m in rows]
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.pad_token = "<unk>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = trl.SFTConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=8,
                           completion_only_loss=True, max_length=64, report_to=[],
                           use_cpu=True, dataset_num_proc=None)  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset,
                             processing_class=tok)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        return float(trainer.compute_loss(model, batch))


def test_first_loss_equals_trl(tmp_path):
    folder, data = make_run_inputs(tmp_path)
    ours = first_sft_loss(folder, data, tmp_path / "run")
    if TRL_FIRST_LOSS is not None:
        assert ours == pytest.approx(TRL_FIRST_LOSS, abs=1e-4)
    theirs = trl_first_loss(folder, data)
    print(f"ours {ours!r} trl {theirs!r}")
    assert ours == pytest.approx(theirs, abs=1e-4)


def _layouts(folder, data, root):
    """On 2 ranks: packed SFT under dp_shard=2, then tp=2; each rank's losses."""
    common = ["--train.steps=3", "--train.micro_batch=2", "--train.global_batch=4"]
    out = {}
    for name, layout in (("dp", ["--parallel.dp_shard=2"]), ("tp", ["--parallel.tp=2"])):
        run_dir = root / name
        sft(load_config(SFTConfig, None, run_args(folder, data, run_dir, *common, *layout)))
        out[name] = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]
    return out


def test_packed_sft_dp_shard_and_tp_equal_one_process(tmp_path):
    folder, data = make_run_inputs(tmp_path, n=18)
    one = tmp_path / "one"
    sft(load_config(SFTConfig, None, run_args(folder, data, one, "--train.steps=3",
                                              "--train.micro_batch=2", "--train.global_batch=4")))  # fmt: skip
    reference = [m["loss"] for m in read_metrics(one / "metrics.jsonl")]
    assert len(reference) == 3 and reference[-1] < reference[0]
    ranks = run_distributed(_layouts, 2, folder, data, tmp_path, timeout=600)
    for name in ("dp", "tp"):
        torch.testing.assert_close(ranks[0][name], reference, rtol=1e-5, atol=1e-5, msg=name)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    folder, data = make_run_inputs(tmp_path, n=2)
    no_reply = tmp_path / "bad.jsonl"
    no_reply.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))  # a gzip stream, say
    latin1 = tmp_path / "latin1.jsonl"  # one Latin-1 line among UTF-8 ones
    latin1.write_bytes(data.read_bytes() + json.dumps({"messages": [
        {"role": "user", "content": "caf\u00e9?"}, {"role": "assistant", "content": "yes"}]},
        ensure_ascii=False).encode("latin-1") + b"\n")  # fmt: skip
    cases = [
        ([], binary, r"binary.jsonl:1: not UTF-8 text \(byte 0x8b at column 2\)"),
        ([], latin1, r"latin1.jsonl:3: not UTF-8 text \(byte 0xe9 at column 47\)"),
        (["--data.chat_template=qwen4"], data, r"data.chat_template='qwen4' is not a template"),
        (["--data.strict=true"], no_reply, r"bad.jsonl:1: .*no assistant reply.*strict"),
        ([], no_reply, r"no sample to train on .*1 without an assistant reply"),
        (["--data.mode=stack"], data, r"data.mode"),
        (["--data.epochs=1", "--optim.warmup_steps=5"], data, r"warmup_steps=5 exceeds the 1 "),
    ]
    capsys.readouterr()  # the model folder's own progress bars
    for extra, path, message in cases:
        run_dir = tmp_path / "run"
        assert guarded(main, run_args(folder, path, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip()
        # the error is one line (log lines, such as a skipped record's, may come before)
        assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err, err
        assert re.search(message, err.splitlines()[-1]), err
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes(tmp_path, capsys):
    from mindspeed_core.testing.faults import check_full_disk_resumes

    folder, data = make_run_inputs(tmp_path, n=4)
    run_dir = tmp_path / "run"
    args = run_args(folder, data, run_dir, "--checkpoint.interval=2", "--train.steps=4",
                    "--train.micro_batch=2", "--train.global_batch=2")  # fmt: skip
    check_full_disk_resumes(main, args, run_dir, capsys, steps=4)
