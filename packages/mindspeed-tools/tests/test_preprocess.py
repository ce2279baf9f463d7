"""`mindspeed preprocess`: raw records in, Megatron indexed datasets out."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mindspeed_core.cli import run as cli_run
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.chat_template import IGNORE_INDEX, encode_text, load_chat_template
from mindspeed_llm.data.indexed import IndexedDataset
from mindspeed_llm.tokenizer import load_tokenizer, train_sentencepiece
from mindspeed_tools.preprocess import parse_args
from mindspeed_tools.preprocess.run import greedy_knapsack, preprocess
from mindspeed_tools.preprocess.sources import count_records

WORDS = ["alpha", "beta", "gamma", "delta", "café", "naïve", "你好", "世界", "🙂", "zeta", "42"]
TEXTS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(120)]
LONG = " ".join(TEXTS) * 20  # a very long document (tens of thousands of tokens)

QWEN = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, tmp_path_factory.mktemp("sp") / "tok", 300)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A byte-level BPE tokenizer folder with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) + "\n" for x in lines
        ),
        encoding="utf-8",
    )
    return path


def run(*argv):
    return preprocess(parse_args([*map(str, argv), "--no-progress"]))


def files_under(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


# -- pretraining ------------------------------------------------------------------------


def test_pretrain_counts_and_reads_back(sp_model, tmp_path):
    corpus = write_jsonl(
        tmp_path / "in" / "corpus.jsonl",
        [
            {"text": TEXTS[0]},
            "\n",  # a blank line: empty
            {"text": ""},  # empty text: empty
            '{"text": "broken\n',  # line 4: broken JSON
            {"text": LONG},
            {"other": "no text key"},  # line 6: missing key
            {"text": 7},  # line 7: wrong type
            "[1, 2]\n",  # line 8: not an object
            {"text": "Zoë 你好 🙂\ttab"},
        ],
    )
    (tmp_path / "in" / "bad.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')  # not UTF-8
    summary = run(
        "--input",
        corpus,
        "--tokenizer",
        sp_model,
        "--output-prefix",
        tmp_path / "out" / "c",
        "--append-eod",
    )
    assert (summary.records, summary.documents, summary.skipped, summary.empty) == (9, 3, 4, 2)
    tok = load_tokenizer(sp_model)
    expected = [tok.encode(t) + [tok.eod_id] for t in (TEXTS[0], LONG, "Zoë 你好 🙂\ttab")]
    assert len(expected[1]) > 10_000 and summary.tokens == sum(map(len, expected))
    prefix = tmp_path / "out" / "c_text_document"
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.uint16  # Megatron's rule for a vocabulary under 65500
    assert [a.tolist() for a in ours[:]] == expected and ours.num_documents == 3
    assert files_under(tmp_path / "out") == ["c_text_document.bin", "c_text_document.idx"]
    # a folder reads every data file in it: the undecodable line is one more bad record
    summary = run(
        "--input",
        tmp_path / "in",
        "--tokenizer",
        sp_model,
        "--output-prefix",
        tmp_path / "dir" / "c",
    )
    assert (summary.records, summary.skipped, summary.documents) == (10, 5, 3)


@pytest.mark.slow  # importing Megatron-Core alone takes ~10 s on a busy CPU
def test_megatron_reads_the_output(sp_model, hf_folder, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS[:20]])
    prefix = tmp_path / "out" / "c"
    run("--input", corpus, "--tokenizer", sp_model, "--output-prefix", prefix, "--append-eod")
    tok = load_tokenizer(sp_model)
    expected = [tok.encode(t) + [tok.eod_id] for t in TEXTS[:20]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    theirs = MegatronIndexed(f"{prefix}_text_document")
    assert [theirs[i].tolist() for i in range(len(theirs))] == expected
    assert theirs.get_document_indices().tolist() == list(range(21))
    assert theirs[0].dtype == np.uint16
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "alpha?", "output": "beta"}])
    run(
        "--input",
        sft,
        "--tokenizer",
        hf_folder,
        "--handler-name",
        "alpaca",
        "--output-prefix",
        prefix,
    )
    labels = MegatronIndexed(f"{prefix}_packed_labels_document")
    ours = IndexedDataset(f"{prefix}_packed_labels_document")
    assert labels[0].dtype == np.int32 and labels[0].tolist() == ours[0].tolist()
    assert labels[0][0] == IGNORE_INDEX and labels[0][-1] != IGNORE_INDEX


def test_workers_give_identical_bytes_and_keys_go_to_their_own_files(sp_model, tmp_path):
    records = [{"text": t, "title": t[:5]} for t in TEXTS] + [{"text": "x"}]  # no title
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}" / "c"
        summary = run(
            "--input",
            corpus,
            "--tokenizer",
            sp_model,
            "--output-prefix",
            prefix,
            "--json-keys",
            "text",
            "title",
            "--workers",
            workers,
            "--add-bos",
        )
        assert summary.skipped == 1  # the record without a title
        outputs[workers] = {
            name: (prefix.parent / name).read_bytes() for name in files_under(prefix.parent)
        }
    assert sorted(outputs[1]) == [
        "c_text_document.bin",
        "c_text_document.idx",
        "c_title_document.bin",
        "c_title_document.idx",
    ]
    assert outputs[1] == outputs[2]
    tok = load_tokenizer(sp_model)
    titles = IndexedDataset(tmp_path / "w1" / "c_title_document")
    assert titles[5].tolist() == [tok.bos_id] + tok.encode(TEXTS[5][:5])


def test_parquet_csv_text_and_glob_inputs(sp_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS[:30], "n": list(range(30))}), tmp_path / "a.parquet")
    with open(tmp_path / "b.csv", "w", encoding="utf-8") as f:
        f.write("id,text\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(TEXTS[30:50])))
    (tmp_path / "c.txt").write_text("\n".join(TEXTS[50:60]) + "\n\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored")
    arrow = tmp_path / "arrow" / "d.arrow"  # an Arrow stream, as datasets saves it
    arrow.parent.mkdir()
    table = pa.table({"text": TEXTS[60:70]})
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    tok = load_tokenizer(sp_model)
    for pattern, texts in [
        ("a.parquet", TEXTS[:30]),
        ("b.csv", TEXTS[30:50]),
        ("*.[pc]*", TEXTS[:50]),  # a glob: a.parquet then b.csv
        ("", TEXTS[:60]),  # the folder: parquet, csv and txt (its blank line is empty)
        ("arrow/d.arrow", TEXTS[60:70]),
    ]:
        out = tmp_path / "out" / (pattern.replace("*", "s") or "all")
        summary = run(
            "--input", tmp_path / pattern, "--tokenizer", sp_model, "--output-prefix", out
        )
        assert summary.empty == (pattern == "")
        assert summary.documents == len(texts) and summary.skipped == 0
        data = IndexedDataset(f"{out}_text_document")
        assert [a.tolist() for a in data[:]] == [tok.encode(t) for t in texts]
    assert not any(p.name.startswith("mindspeed-hf-") for p in tmp_path.iterdir())
    assert count_records([tmp_path / "a.parquet", tmp_path / "c.txt"]) == 30 + 11
    assert count_records([tmp_path / "b.csv"]) is None


# -- chat data ------------------------------------------------------------------------

ALPACA = [
    {"instruction": "Say hi", "input": "", "output": "hi 🙂"},
    {"instruction": "Add", "input": "1999 42", "output": "2041", "system": "Be exact."},
    {"instruction": "Again", "output": "gamma", "history": [["alpha?", "beta"]]},
    {"instruction": "No output", "bad": True},  # missing key
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "alpha 你好"},
            {"from": "gpt", "value": "beta"},
            {"from": "human", "value": "gamma?"},
            {"from": "gpt", "value": "delta"},
        ]
    },
    {"conversations": [{"from": "robot", "value": "?"}], "bad": True},  # unknown role
    {"conversations": [{"from": "human", "value": "only a question"}], "bad": True},  # no reply
]
MESSAGES = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "zeta?"},
            {"role": "assistant", "content": "42"},
        ]
    },
    {"messages": "not a list", "bad": True},
]


def replies_of(record):
    """The assistant texts a record should train on."""
    if "output" in record:
        return [t for pair in record.get("history", []) for t in pair[1:]] + [record["output"]]
    turns = record.get("conversations") or record["messages"]
    return [
        t.get("value", t.get("content"))
        for t in turns
        if t.get("from", t.get("role")) in ("gpt", "assistant")
    ]


@pytest.mark.parametrize(
    "handler, records",
    [
        ("AlpacaStyleInstructionHandler", ALPACA),
        ("SharegptStyleInstructionHandler", SHAREGPT),
        ("messages", MESSAGES),
    ],
)
def test_instruction_labels_mask_exactly_the_prompt(hf_folder, tmp_path, handler, records):
    corpus = write_jsonl(tmp_path / "sft.jsonl", records)
    summary = run(
        "--input",
        corpus,
        "--tokenizer",
        hf_folder,
        "--handler-name",
        handler,
        "--output-prefix",
        tmp_path / "o" / "sft",
    )
    good = [r for r in records if not r.get("bad")]
    assert summary.documents == len(good) and summary.skipped == len(records) - len(good)
    sets = {
        k: IndexedDataset(tmp_path / "o" / f"sft_packed_{k}_document")
        for k in ("input_ids", "attention_mask", "labels")
    }
    assert {d.dtype for d in sets.values()} == {np.dtype(np.int32)}
    for d in sets.values():  # the same document boundaries in all three
        assert d.document_indices.tolist() == list(range(len(good) + 1))
        assert d.sequence_lengths.tolist() == sets["input_ids"].sequence_lengths.tolist()
    assert summary.tokens == int(sets["input_ids"].sequence_lengths.sum())
    tok = load_tokenizer(hf_folder)
    im_end = tok.token_to_id("<|im_end|>")
    for i, record in enumerate(good):
        ids, labels = sets["input_ids"][i], sets["labels"][i]
        assert (sets["attention_mask"][i] == 1).all()
        trained = labels != IGNORE_INDEX
        assert (labels[trained] == ids[trained]).all()
        # the supervised tokens are exactly each reply followed by <|im_end|>\n
        want = []
        for reply in replies_of(record):
            want += encode_text(tok, reply + "<|im_end|>\n")
        assert labels[trained].tolist() == want
        assert ids[~trained].tolist().count(im_end) == ids.tolist().count(im_end) - len(
            replies_of(record)
        )


def test_tools_reach_the_template(hf_folder, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(
        "{% if tools %}{{ 'TOOLS ' + tools | tojson + '\\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tools = [{"name": "add", "parameters": {"a": "int"}}]
    chat = [{"role": "user", "content": "1999 42"}, {"role": "assistant", "content": "2041"}]
    records = [
        {"messages": chat, "tools": tools},
        {
            "conversations": [{"from": "human", "value": "1999"}, {"from": "gpt", "value": "42"}],
            "tools": json.dumps(tools),
        },  # LLaMA-Factory stores them as a JSON string
        {"messages": chat, "tools": "{not json", "bad": True},
    ]
    for handler in ("messages", "sharegpt"):
        subset = [
            r for r in records if r.get("bad") or (handler == "messages") == ("messages" in r)
        ]
        corpus = write_jsonl(tmp_path / f"{handler}.jsonl", subset)
        summary = run(
            "--input",
            corpus,
            "--tokenizer",
            hf_folder,
            "--handler-name",
            handler,
            "--chat-template",
            template,
            "--output-prefix",
            tmp_path / handler / "t",
        )
        assert (summary.documents, summary.skipped) == (1, 1)
        tok = load_tokenizer(hf_folder)
        ids = IndexedDataset(tmp_path / handler / "t_packed_input_ids_document")[0]
        assert tok.decode(ids.tolist()).startswith(
            'TOOLS [{"name": "add", "parameters": {"a": "int"}}]'
        )


def test_pairwise_outputs(hf_folder, tmp_path):
    records = [
        {"prompt": "alpha or beta?", "chosen": "alpha", "rejected": "beta 🙂"},
        {
            "instruction": "Pick",
            "input": "1999",
            "chosen": {"role": "assistant", "content": "42"},
            "rejected": [{"role": "assistant", "content": "zeta"}],
            "system": "Be brief.",
        },
        {"prompt": "no rejected", "chosen": "x"},  # bad
        {"prompt": "same?", "chosen": "same", "rejected": "same"},  # bad: nothing to prefer
        {
            "conversations": [{"from": "human", "value": "gamma?"}],
            "chosen": {"from": "gpt", "value": "delta"},
            "rejected": {"from": "gpt", "value": "zeta"},
        },
    ]
    corpus = write_jsonl(tmp_path / "p.jsonl", records)
    summary = run(
        "--input",
        corpus,
        "--tokenizer",
        hf_folder,
        "--handler-name",
        "AlpacaStylePairwiseHandler",
        "--output-prefix",
        tmp_path / "o" / "dpo",
    )
    assert (summary.documents, summary.skipped) == (3, 2)
    keys = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    assert files_under(tmp_path / "o") == sorted(
        f"dpo_packed_{k}_document.{s}" for k in keys for s in ("bin", "idx")
    )
    data = {k: IndexedDataset(tmp_path / "o" / f"dpo_packed_{k}_document") for k in keys}
    tok = load_tokenizer(hf_folder)
    template = load_chat_template(hf_folder)
    pairs = [("alpha", "beta 🙂"), ("42", "zeta"), ("delta", "zeta")]
    assert summary.tokens == sum(
        int(d.sequence_lengths.sum()) for k, d in data.items() if "input_ids" in k
    )
    for i, (chosen, rejected) in enumerate(pairs):
        for side, reply in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = data[f"{side}_input_ids"][i], data[f"{side}_labels"][i]
            prompt_len = int((labels == IGNORE_INDEX).sum())
            assert (labels[:prompt_len] == IGNORE_INDEX).all()
            assert labels[prompt_len:].tolist() == encode_text(tok, reply + "<|im_end|>\n")
            assert ids[prompt_len:].tolist() == labels[prompt_len:].tolist()
        n = int((data["chosen_labels"][i] == IGNORE_INDEX).sum())
        assert (
            data["chosen_input_ids"][i][:n].tolist() == data["rejected_input_ids"][i][:n].tolist()
        )
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pick\n1999"}]
    prompt = encode_text(tok, template.render(second, add_generation_prompt=True))
    assert data["chosen_input_ids"][1][: len(prompt)].tolist() == prompt
    third = [{"role": "user", "content": "gamma?"}]  # sharegpt from/value turns
    prompt = encode_text(tok, template.render(third, add_generation_prompt=True))
    assert data["rejected_input_ids"][2][: len(prompt)].tolist() == prompt
    # two workers (each loading the tokenizer and template) write the same bytes
    run(
        *["--input", corpus, "--tokenizer", hf_folder, "--handler-name", "pairwise"],
        *["--output-prefix", tmp_path / "w2" / "dpo", "--workers", 2],
    )
    for name in files_under(tmp_path / "o"):
        assert (tmp_path / "w2" / name).read_bytes() == (tmp_path / "o" / name).read_bytes()


def test_json_array_map_keys_and_max_samples(hf_folder, tmp_path):
    records = [{"question": f"q{i}", "answer": f"a{i}", "input": ""} for i in range(5)]
    (tmp_path / "qa.json").write_text(json.dumps(records, indent=2), encoding="utf-8-sig")
    summary = run(
        "--input",
        tmp_path / "qa.json",
        "--tokenizer",
        hf_folder,
        "--handler-name",
        "alpaca",
        "--map-keys",
        '{"prompt": "question", "response": "answer"}',
        "--max-samples",
        3,
        "--output-prefix",
        tmp_path / "o" / "qa",
    )
    assert (summary.records, summary.documents) == (3, 3)
    # MindSpeed-LLM flags that change nothing are accepted
    compat = ["--tokenizer-type", "PretrainedFromHF", "--log-interval", "1000"]
    compat_cfg = parse_args(["--input", "a", "--tokenizer", "t", "--output-prefix", "o", *compat])
    assert compat_cfg.handler.name == "pretrain"
    tok = load_tokenizer(hf_folder)
    labels = IndexedDataset(tmp_path / "o" / "qa_packed_labels_document")
    assert [x[x != IGNORE_INDEX].tolist() for x in labels[:]] == [
        encode_text(tok, f"a{i}<|im_end|>\n") for i in range(3)
    ]
    (tmp_path / "broken.json").write_text('[{"question": "q", "answer": "a"},\n {"oops"]')
    with pytest.raises(DataError, match=r"broken.json:2: not a valid JSON array"):
        run(
            "--input",
            tmp_path / "broken.json",
            "--tokenizer",
            hf_folder,
            "--handler-name",
            "alpaca",
            "--output-prefix",
            tmp_path / "b" / "x",
        )
    assert not (tmp_path / "b").exists()


def test_seq_length_drops_and_pack_fills_rows(hf_folder, tmp_path):
    records = [{"instruction": t, "output": t[::-1]} for t in TEXTS[:40]]
    records.append({"instruction": LONG[:2000], "output": "x"})  # longer than seq-length
    corpus = write_jsonl(tmp_path / "a.jsonl", records)
    plain = run(
        "--input",
        corpus,
        "--tokenizer",
        hf_folder,
        "--handler-name",
        "alpaca",
        "--seq-length",
        128,
        "--output-prefix",
        tmp_path / "plain" / "a",
    )
    assert (plain.documents, plain.too_long) == (40, 1)
    packed = run(
        "--input",
        corpus,
        "--tokenizer",
        hf_folder,
        "--handler-name",
        "alpaca",
        "--seq-length",
        128,
        "--pack",
        "--neat-pack",
        "--output-prefix",
        tmp_path / "pack" / "a",
    )
    assert packed.too_long == 0 and packed.documents == 41  # neat-pack truncates instead
    ids = IndexedDataset(tmp_path / "pack" / "a_packed_input_ids_document")
    mask = IndexedDataset(tmp_path / "pack" / "a_packed_attention_mask_document")
    labels = IndexedDataset(tmp_path / "pack" / "a_packed_labels_document")
    assert set(ids.sequence_lengths.tolist()) == {128} and len(ids) < 41
    pad = load_tokenizer(hf_folder).pad_id
    segments = 0
    for row_ids, row_mask, row_labels in zip(ids[:], mask[:], labels[:], strict=True):
        padding = row_mask == 0
        assert padding[-1] and (row_ids[padding] == pad).all()
        assert (row_labels[padding] == IGNORE_INDEX).all()
        used = row_mask[~padding]
        assert used.tolist() == sorted(used.tolist()) and used[0] == 1  # segments 1..k
        segments += int(used.max())
    assert segments == 41
    # the same samples, regrouped: segment k of a row is one whole sample
    segments = sorted(
        tuple(row[m == k].tolist())
        for row, m in zip(ids[:], mask[:], strict=True)
        for k in range(1, int(m.max()) + 1)
    )
    plain_ids = IndexedDataset(tmp_path / "plain" / "a_packed_input_ids_document")
    truncated = max(segments, key=len)
    assert len(truncated) == 127 and sum(map(len, segments)) == packed.tokens
    segments.remove(truncated)
    assert segments == sorted(tuple(x.tolist()) for x in plain_ids[:])
    assert greedy_knapsack([5, 1, 4, 3, 9], 9) == [[9], [5, 4], [3, 1]]


# -- bad input ------------------------------------------------------------------------


def test_strict_stops_at_the_bad_line_and_leaves_nothing(sp_model, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS[:5]] + ["{oops\n"])
    out = tmp_path / "new" / "deeper" / "c"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindspeed_tools.preprocess",
            "--input",
            str(corpus),
            "--tokenizer",
            str(sp_model),
            "--output-prefix",
            str(out),
            "--strict",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{corpus}:6: broken JSON" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "new").exists()


def test_cli_mistakes_are_one_line_exit_2(sp_model, hf_folder, tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "alpha"}])
    (tmp_path / "bad.parquet").write_text("not parquet")
    cases = [
        (["--input", tmp_path / "bad.parquet"], "cannot read parquet file"),
        (["--input", tmp_path / "missing.jsonl"], "input does not exist"),
        (["--input", "tatsu-lab/alpaca"], "does not download at run time"),
        (["--input", corpus, "--tokenizer", hf_folder, "--add-bos"], "has no BOS token"),
        (
            ["--input", corpus, "--handler-name", "AlpacaStyleHandler"],
            "unknown --handler-name 'AlpacaStyleHandler'; did you mean",
        ),
        (["--input", corpus, "--workers", "0"], "--workers must be at least 1"),
        (["--input", corpus, "--prompt-type", "qwen"], "pass --chat-template"),
        (["--input", corpus, "--seq-length", "8"], "--seq-length and --pack apply"),
        (["--input", corpus, "--bogus"], "unrecognized arguments: --bogus"),
        (["--input", tmp_path / "c.jsonl", "--json-keys", "body"], "no usable records"),
        (["--input", tmp_path / "nothing*.jsonl"], "no .arrow/.csv/.json"),
    ]
    for args, message in cases:
        argv = ["preprocess", "--tokenizer", sp_model, "--output-prefix", tmp_path / "o" / "x"]
        assert cli_run([str(a) for a in argv + args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1], (args, err)
    assert not (tmp_path / "o").exists()
    with pytest.raises(DataError, match="tokenizer path does not exist"):
        run("--input", corpus, "--tokenizer", tmp_path / "nope", "--output-prefix", tmp_path / "x")
    with pytest.raises(ConfigError, match="--map-keys is not valid JSON"):
        parse_args(["--input", "a", "--tokenizer", "t", "--output-prefix", "o", "--map-keys", "{"])


@pytest.mark.slow
def test_pretrain_trains_on_preprocessed_data(sp_model, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS * 4])
    run(
        "--input",
        corpus,
        "--tokenizer",
        sp_model,
        "--output-prefix",
        tmp_path / "d" / "c",
        "--append-eod",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindspeed_llm.pretrain",
            f"--data.paths=[{tmp_path / 'd' / 'c_text_document'}]",
            f"--data.tokenizer={sp_model}",
            "--data.seq_len=32",
            "--data.split=90,10,0",
            "--logging.log_interval=1",
            "--train.steps=2",
            "--train.micro_batch=2",
            "--train.global_batch=2",
            "--optim.warmup_steps=1",
            "--train.eval_interval=0",
            "--logging.progress=false",
            "--logging.tensorboard=false",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--train.device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]


def _children(pid):
    """Process ids whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _gone(pids, seconds):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _kill_preprocess_and_rerun(sp_model, tmp_path):
    """Kill a 2-worker preprocess with SIGKILL while its workers start or work: they must be
    gone within 5 s, and the rerun sweeps the killed run's temporaries."""
    import signal
    import time

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS * 3000])
    out = tmp_path / "c"
    argv = [sys.executable, "-m", "mindspeed_tools.preprocess", "--input", str(corpus)]
    argv += ["--tokenizer", str(sp_model), "--output-prefix", str(out), "--workers", "2"]
    parent = subprocess.Popen(
        [*argv, "--no-progress"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(workers := _children(parent.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # two workers and multiprocessing's resource tracker
    assert len(workers) >= 3 and parent.poll() is None, "preprocess ended before the kill"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    # The workers were still importing their module (torch: 5-15 s) when the parent died:
    # mindspeed_core.lifeline arms before that import, so they go within a second or two.
    assert _gone(workers, 5), [(p, _state(p)) for p in workers]
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert left, "the killed run should have left its temporaries"
    assert run("--input", corpus, "--tokenizer", sp_model, "--output-prefix", out).documents > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c.jsonl",
        "c_text_document.bin",
        "c_text_document.idx",
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_parent_and_its_temporaries_go_next_time(sp_model, tmp_path):
    _kill_preprocess_and_rerun(sp_model, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_parent_ten_times_under_load(sp_model, tmp_path):
    # Two busy processes beside it, as on a loaded CI machine (Q3's reproduction).
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for attempt in range(10):
            _kill_preprocess_and_rerun(sp_model, tmp_path / str(attempt))
    finally:
        for burner in burners:
            burner.kill()


def test_a_full_disk_is_one_line_and_leaves_nothing(sp_model, tmp_path, capsys, monkeypatch):
    import errno

    from mindspeed_llm.data.indexed import IndexedDatasetWriter

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    real = IndexedDatasetWriter.add_item
    calls = []

    def fills_up(self, tokens):
        calls.append(1)
        if len(calls) > 50:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, tokens)

    monkeypatch.setattr(IndexedDatasetWriter, "add_item", fills_up)
    argv = ["preprocess", "--input", corpus, "--tokenizer", sp_model]
    assert cli_run([str(a) for a in [*argv, "--output-prefix", tmp_path / "o" / "x"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no space left on device for "), err
    assert (
        "x_text_document.bin (needed ~0 MB" in err[0] or "x_text_document.bin (needed ~" in err[0]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
