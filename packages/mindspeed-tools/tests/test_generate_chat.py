"""`mindspeed generate` and `mindspeed chat` on a tiny saved Llama with a word-level
tokenizer: generate's JSONL holds the engine's greedy tokens, chat keeps history (the
second rendered prompt holds the first exchange), `clear` and `exit` work, and bad input
is one line with exit 2."""

import io
import json
from pathlib import Path

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_core.testing import import_sibling
from mindspeed_llm.generation import GenerationConfig, Generator, generate
from mindspeed_llm.loading import load_model
from mindspeed_llm.tokenizer import load_tokenizer

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")
ROLES = ["user:", "assistant:", "system:"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json over the model's 512 ids: <s> 0, </s> 1, <unk> 2, the
    role words, then w6..w511; the chat template above in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", *ROLES, *(f"w{i}" for i in range(6, 512))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    models_hf.make_hf("llama").save_pretrained(folder)
    _save_tokenizer(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 1, "max_new_tokens": 10})
    )
    return folder


@pytest.fixture(scope="module")
def engine(model_dir):
    model, _ = load_model(model_dir)
    return Generator(model, load_tokenizer(model_dir), GenerationConfig.from_file(model_dir))


def _jsonl(text):
    return [json.loads(line) for line in text.splitlines()]


def test_generate_jsonl_equals_the_engine(model_dir, engine, capsys, tmp_path):
    prompts = ["w10 w20 w30", "w7", "w300 w301 w302 w303 w304"]
    assert cli(["generate", "--model", str(model_dir), *prompts[:2], "--batch-size", "1"]) == 0
    printed = _jsonl(capsys.readouterr().out)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": prompts[2], "id": 7}) + "\n\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl")]
    assert cli([*argv, "--output", str(out), "--max-new-tokens", "6"]) == 0
    written = _jsonl(out.read_text())
    assert [r["prompt"] for r in printed + written] == prompts and written[0]["id"] == 7
    config = engine.resolved_config()  # the folder's generation_config.json: 10 tokens, eos 1
    expected = generate(engine.model, [engine.encode(p) for p in prompts[:2]], config)
    expected += generate(
        engine.model, [engine.encode(prompts[2])], config.replace(max_new_tokens=6)
    )
    assert [r["token_ids"] for r in printed + written] == expected
    for record, tokens in zip(printed + written, expected, strict=True):
        assert record["completion"] == engine.tokenizer.decode(tokens)
        assert record["finish_reason"] == ("stop" if tokens[-1] == 1 else "length")
    assert len(expected[0]) == 10 and len(expected[2]) == 6  # defaults and overrides apply


def test_generate_from_a_converted_checkpoint(model_dir, capsys, tmp_path):
    from mindspeed_tools.convert import hf_to_mindspeed

    converted = hf_to_mindspeed(model_dir, tmp_path / "converted")
    outputs = []
    for folder in (model_dir, converted):
        assert cli(["generate", "--model", str(folder), "w10 w20", "w40"]) == 0
        outputs.append(_jsonl(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and len(outputs[0][0]["token_ids"]) == 10


def test_generate_int8_equals_the_engine_on_int8_weights(model_dir, capsys):
    from mindspeed_llm.generation.quantize import Int8Linear, quantize_weights

    prompts = ["w10 w20 w30", "w7"]
    assert cli(["generate", "--model", str(model_dir), *prompts, "--quantize", "int8"]) == 0
    printed = _jsonl(capsys.readouterr().out)
    model, _ = load_model(model_dir)
    quantize_weights(model)
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 7 + 1  # and the head
    quantized = Generator(model, load_tokenizer(model_dir), GenerationConfig.from_file(model_dir))
    expected = generate(model, [quantized.encode(p) for p in prompts], quantized.resolved_config())
    assert [r["token_ids"] for r in printed] == expected
    # half-precision activations over int8 weights: the KV cache takes the activations'
    # dtype (it took the scales' fp32 and the attention refused the mix)
    for dtype in ("fp16", "bf16"):
        assert cli(["generate", "--model", str(model_dir), *prompts, "--quantize", "int8",
                    "--dtype", dtype]) == 0, dtype  # fmt: skip
        assert len(_jsonl(capsys.readouterr().out)) == 2


def test_generate_beam_search_equals_the_engine(model_dir, engine, capsys):
    prompts = ["w10 w20 w30", "w7"]
    argv = ["generate", "--model", str(model_dir), *prompts, "--num-beams", "3"]
    assert cli([*argv, "--length-penalty", "0.5", "--early-stopping", "never"]) == 0
    printed = _jsonl(capsys.readouterr().out)
    config = engine.resolved_config().replace(num_beams=3, length_penalty=0.5, early_stopping="never")
    expected = generate(engine.model, [engine.encode(p) for p in prompts], config)
    assert [r["token_ids"] for r in printed] == expected
    assert expected != generate(engine.model, [engine.encode(p) for p in prompts],
                                engine.resolved_config())  # not greedy's  # fmt: skip


def test_generate_plain_input_file_and_sampling(model_dir, capsys, tmp_path):
    (tmp_path / "prompts.txt").write_text("w10 w20\n\nw30\n")
    argv = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "prompts.txt")]
    argv += ["--temperature", "0.9", "--top-k", "5", "--seed", "3"]
    assert cli(argv) == 0
    first = _jsonl(capsys.readouterr().out)
    assert [r["prompt"] for r in first] == ["w10 w20", "w30"]
    assert cli(argv) == 0 and _jsonl(capsys.readouterr().out) == first  # seeded: same output


def test_generate_chat_option_renders_the_template(model_dir, engine, capsys):
    assert cli(["generate", "--model", str(model_dir), "--chat", "w10 w11"]) == 0
    record = _jsonl(capsys.readouterr().out)[0]
    prompt = engine.encode("user: w10 w11 assistant:", add_bos=False)
    assert prompt[0] == 3  # "user:", no BOS: the template decides
    assert record["token_ids"] == generate(engine.model, [prompt], engine.resolved_config())[0]


def _chat(monkeypatch, capsys, model_dir, script, *extra):
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    status = cli(["chat", "--model", str(model_dir), "--show-prompt", *extra])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err


def test_chat_history_clear_and_exit(model_dir, engine, monkeypatch, capsys):
    script = "w10 w11\nw12\nclear\nw12\nexit\nw13\n"
    status, replies, err = _chat(monkeypatch, capsys, model_dir, script, "--max-new-tokens", "4")
    assert status == 0 and len(replies) == 3  # nothing after exit
    prompts = [p for p in err.split("\n") if p.startswith("user:")]
    assert prompts[0] == "user: w10 w11 assistant:"
    # the second prompt carries the first exchange, reply included
    assert prompts[1] == f"user: w10 w11 assistant: {replies[0]} user: w12 assistant:"
    assert prompts[2] == "user: w12 assistant:"  # after clear
    assert "(new conversation)" in err
    config = engine.resolved_config(max_new_tokens=4)
    assert replies[0] == engine.generate([engine.encode(prompts[0], add_bos=False)], config)[0]
    assert replies[2] == engine.generate([engine.encode(prompts[2], add_bos=False)], config)[0]


def test_chat_system_message_and_end_of_input(model_dir, monkeypatch, capsys):
    status, replies, err = _chat(
        monkeypatch, capsys, model_dir, "w20\n", "--system", "w9", "--max-new-tokens", "2"
    )
    assert status == 0 and len(replies) == 1  # end of input leaves like exit
    assert "system: w9 user: w20 assistant:" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "meta-llama/Llama-3-8B", "hi"], "Hugging Face Hub name"),
        (["chat", "--model", "meta-llama/Llama-3-8B"], "Hugging Face Hub name"),
        (["generate", "--model", "{empty}", "hi"], "has no config.json"),
        (["chat", "--model", "{empty}"], "has no config.json"),
        (["generate", "--model", "{model}"], "no prompts"),
        (["generate", "--model", "{model}", "--input", "{missing}"], "does not exist"),
        (["generate", "--model", "{model}", "--input", "{bad_jsonl}"], "bad.jsonl:2: expected"),
        (["generate", "--model", "{model}", "--input", "{latin1}"],
         "latin1.txt:2: not UTF-8 text (byte 0xe9 at column 4)"),
        (["generate", "--model", "{model}", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "{model}", "hi", "--top-k", "many"], "invalid int value"),
        (["generate", "--model", "{model}", "hi", "--quantize", "int4"], "invalid choice: 'int4'"),
        (["generate", "--model", "{model}", "hi", "--tp", "2"], "--tp 2 runs under torchrun"),
        (["chat", "--model", "{model}", "--tp", "0"], "--tp must be at least 1"),
        (["generate", "--model", "{model}", "hi", "--num-beams", "2", "--temperature", "0.5"],
         "beam search here is deterministic"),
        (["generate", "--model", "{model}", "hi", "--output", "{empty}"], "is a folder"),
    ],
)
def test_bad_input_is_one_line(argv, message, model_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w7"}\n{"text": "w8"}\n')
    (tmp_path / "latin1.txt").write_bytes("w7\ncaf\u00e9\n".encode("latin-1"))
    paths = {
        "latin1": tmp_path / "latin1.txt",
        "model": model_dir,
        "empty": tmp_path / "empty",
        "missing": tmp_path / "missing.txt",
        "bad_jsonl": tmp_path / "bad.jsonl",
    }
    argv = [a.format(**paths) for a in argv]
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert message in captured.err
    assert list((tmp_path / "empty").iterdir()) == []  # nothing half-written


def _looping_model(model_dir, tmp_path):
    """The model folder with a chat template that loops over range(100000000)."""
    import shutil

    folder = tmp_path / "looping"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for i in range(100000000) %}{% endfor %}{{ messages[0]['content'] }}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _stdin_bytes(data: bytes):
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("argv", "prompt argument 2 is not valid UTF-8 (byte 0xff at character 2)"),
        ("stdin", "stdin line 2 is not valid UTF-8 (byte 0xff)"),
        ("chat", "input is not valid UTF-8 (byte 0xff)"),
        ("chat-surrogate", "input line is not valid UTF-8 (byte 0xfe at character 0)"),
        ("template-generate", "is unsafe to run: Range too big"),
        ("template-chat", "is unsafe to run: Range too big"),
    ],
)
def test_non_utf8_input_and_runaway_templates_are_one_line(
    case, message, model_dir, tmp_path, monkeypatch, capsys
):
    model = str(model_dir)
    if case.startswith("template"):
        model = str(_looping_model(model_dir, tmp_path))
    if case == "stdin":
        monkeypatch.setattr("sys.stdin", _stdin_bytes(b"w7\nw8 \xff\n"))
    if case == "chat":
        monkeypatch.setattr("sys.stdin", _stdin_bytes(b"w7 \xff\n"))
    if case == "chat-surrogate":  # stdin decoded with surrogateescape (a C locale)
        monkeypatch.setattr("sys.stdin", io.StringIO("\udcfe w7\n"))
    if case == "template-chat":
        monkeypatch.setattr("sys.stdin", io.StringIO("w7\n"))
    argv = {
        "argv": ["generate", "--model", model, "w7", "ok\udcff"],
        "stdin": ["generate", "--model", model, "--input", "-"],
        "template-generate": ["generate", "--model", model, "--chat", "w7"],
    }.get(case, ["chat", "--model", model])
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert message in captured.err, captured.err


def _torchrun(args, stdin=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDSPEED_DEVICE": "cpu"}
    code = "import sys; from mindspeed_core.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--no-python", sys.executable, "-c", code, *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.distributed
def test_generate_and_chat_under_tp2_equal_one_process(model_dir, monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 ... generate|chat --tp 2`: rank 0 prints once, the same
    tokens as one process (greedy and beams); chat reads on rank 0 and replies the same."""
    prompts = ["w10 w20 w30", "w7"]
    argv = ["generate", "--model", str(model_dir), *prompts, "--num-beams", "2"]
    assert cli(argv) == 0
    alone = _jsonl(capsys.readouterr().out)
    assert _jsonl(_torchrun([*argv, "--tp", "2"]).stdout) == alone
    script = "w10 w20\nw30\nexit\n"
    status, alone, _ = _chat(monkeypatch, capsys, model_dir, script, "--max-new-tokens", "4")
    done = _torchrun(["chat", "--model", str(model_dir), "--max-new-tokens", "4", "--tp", "2"],
                     stdin=script)  # fmt: skip
    assert status == 0 and len(alone) == 2
    assert done.stdout.splitlines() == alone  # once (rank 0), and the same replies
