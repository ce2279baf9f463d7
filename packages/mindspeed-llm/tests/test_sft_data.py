"""SFT data: the assistant mask equals transformers' `return_assistant_tokens_mask`,
alpaca and sharegpt records give the golden supervised text, bad records are counted
(or fatal with strict), long samples are cut or dropped, and a packed batch gives the
loss and gradients of the same samples padded."""

import json

import numpy as np
import pytest
import torch

from mindspeed_core.errors import DataError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.chat_template import encode_text, load_chat_template
from mindspeed_llm.data.collate import IGNORE_INDEX, check_batch
from mindspeed_llm.data.sft import (
    SFTStats,
    collate_rows,
    encode_sample,
    fit_samples,
    pack_rows,
    tokenize_file,
)
from mindspeed_llm.data.sft_records import record_messages
from mindspeed_llm.data.sft_templates import TEMPLATES
from mindspeed_llm.tokenizer import load_tokenizer

make_folder = import_sibling(__file__, "test_chat_template").make_folder

# ChatML with transformers' {% generation %} markers around what the model generates.
GENERATION_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
THREE_TURNS = [
    {"role": "system", "content": "You answer about apples."},
    {"role": "user", "content": "user 1 asks about apples"},
    {"role": "assistant", "content": "the café answers 7"},
    {"role": "user", "content": "and rivers?"},
    {"role": "assistant", "content": "let me ask the tools"},
    {"role": "tool", "content": "rivers 14"},
    {"role": "assistant", "content": "user 2 answers 14"},
]


def supervised_mask(labels):
    """Our shifted labels -> which input tokens are supervised (transformers' mask)."""
    return [0] + [int(x != IGNORE_INDEX) for x in labels[:-1]]


def test_assistant_mask_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = make_folder(tmp_path / "tok", GENERATION_CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    out = hf.apply_chat_template(THREE_TURNS, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)  # fmt: skip
    ids, labels = encode_sample(load_chat_template(folder), load_tokenizer(folder), THREE_TURNS)
    assert ids.tolist() == list(out["input_ids"])
    assert supervised_mask(labels) == list(out["assistant_masks"])
    assert sum(out["assistant_masks"]) > 0
    # labels are the next token wherever supervised (the batch contract's shift)
    sup = labels != IGNORE_INDEX
    assert (labels[sup] == ids[1:][sup[:-1]]).all() and labels[-1] == IGNORE_INDEX


def _supervised_text(tok, ids, labels):
    return tok.decode([int(t) for t in labels if t != IGNORE_INDEX])


def test_alpaca_and_sharegpt_golden(tmp_path):
    folder = make_folder(tmp_path / "tok", TEMPLATES["chatml"])
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    alpaca = {"instruction": "add", "input": "2 and 3", "output": "5", "system": "be brief",
              "history": [["hi", "hello"]]}  # fmt: skip
    messages = record_messages(alpaca, "alpaca")
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "add\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    ids, labels = encode_sample(template, tok, messages)
    im_end = tok.token_to_id("<|im_end|>")
    trained = [int(t) for t in labels if t != IGNORE_INDEX]
    assert trained == encode_text(tok, "hello<|im_end|>\n5<|im_end|>\n")
    assert trained.count(im_end) == 2
    sharegpt = {"system": "s", "conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
        {"from": "observation", "value": "obs"}, {"from": "gpt", "value": "b"}]}  # fmt: skip
    messages = record_messages(sharegpt, "sharegpt")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    ids, labels = encode_sample(template, tok, messages)
    assert [int(t) for t in labels if t != IGNORE_INDEX] == encode_text(
        tok, "a<|im_end|>\nb<|im_end|>\n"
    )


def test_bad_records_are_counted_or_fatal_and_long_samples_cut(tmp_path):
    folder = make_folder(tmp_path / "tok", TEMPLATES["chatml"])
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    path = tmp_path / "data.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "no reply here"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "x " * 40}]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, stats = tokenize_file(path, "messages", template, tok, cache_dir=tmp_path / "c")
    assert (stats.records, stats.samples, stats.no_reply, stats.bad) == (4, 2, 1, 1)
    again, stats2 = tokenize_file(path, "messages", template, tok, cache_dir=tmp_path / "c")
    assert stats2 == stats and all((a[0] == b[0]).all() for a, b in zip(samples, again, strict=True))
    # a cache that cannot be read (truncated, or a byte flipped: the zip's CRC) is rebuilt
    (cache,) = (tmp_path / "c").glob("*.npz")
    whole = cache.read_bytes()
    flipped = bytearray(whole)
    flipped[len(whole) // 3] ^= 0xFF
    for damaged in (whole[: len(whole) // 2], bytes(flipped)):
        cache.write_bytes(damaged)
        rebuilt, stats3 = tokenize_file(path, "messages", template, tok, cache_dir=tmp_path / "c")
        assert stats3 == stats and all((a[0] == b[0]).all() for a, b in zip(samples, rebuilt, strict=True))
        assert cache.read_bytes() == whole
    with pytest.raises(DataError, match=r"data.paths: .*missing.jsonl does not exist"):
        tokenize_file(tmp_path / "missing.jsonl", "messages", template, tok, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match=r"data.jsonl:2: .*no assistant.*strict"):
        tokenize_file(path, "messages", template, tok, strict=True)
    short = len(samples[0][0])
    cut = SFTStats()
    kept = fit_samples(samples, short + 1, "truncate", cut)
    assert (cut.truncated, cut.dropped, len(kept[1][0])) == (1, 0, short + 1)
    assert kept[1][1][-1] == IGNORE_INDEX
    dropped = SFTStats()
    assert len(fit_samples(samples, short + 1, "drop", dropped)) == 1 and dropped.dropped == 1
    # cut where nothing supervised is left: dropped even when truncating
    prompt_only = SFTStats()
    assert fit_samples(samples[1:], 4, "truncate", prompt_only) == [] and prompt_only.dropped == 1


FORMATS = {
    "alpaca": {"instruction": "count apples", "input": "3 and 4", "output": "7", "system": "be brief"},
    "sharegpt": {"system": "be brief", "conversations": [{"from": "human", "value": "count apples\n3 and 4"},
                                                         {"from": "gpt", "value": "7"}]},
    "messages": {"messages": [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": "count apples\n3 and 4"},
                              {"role": "assistant", "content": "7"}]},
    "pairwise": {"prompt": "count apples", "chosen": "7", "rejected": "8"},
    "unpaired": {"prompt": "count apples", "completion": "7", "label": True},
    "stepwise": {"prompt": "count apples", "completions": ["3 + 4", "= 7"], "labels": [True, True]},
}  # fmt: skip


def test_handler_auto_recognises_each_format_and_refuses_a_mixed_file(tmp_path, caplog):
    """`data.handler: auto`: each instruction format is told from its keys and gives the
    samples its named handler gives (the three records say the same); preference and step
    records are sent to their command; a mixed file and an unknown record are refused naming
    the line and the keys."""
    from mindspeed_llm.data.sft_records import detect_record_format

    assert {fmt: detect_record_format(r)[0] for fmt, r in FORMATS.items()} == {f: f for f in FORMATS}
    assert detect_record_format({"text": "a"})[0] is None and detect_record_format([1])[0] is None
    folder = make_folder(tmp_path / "tok", TEMPLATES["chatml"])
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    samples = {}
    for fmt in ("alpaca", "sharegpt", "messages"):
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(FORMATS[fmt]) + "\n")
        with caplog.at_level("INFO", logger="mindspeed.sft"):
            samples[fmt] = tokenize_file(path, "auto", template, tok)[0]
        assert f"data.handler auto: {fmt} records" in caplog.text
        named = tokenize_file(path, fmt, template, tok)[0]
        assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(samples[fmt], named, strict=True))
    assert (samples["alpaca"][0][0] == samples["messages"][0][0]).all()  # the same conversation
    for fmt, command in (("pairwise", "dpo"), ("unpaired", "kto"), ("stepwise", "prm")):
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(FORMATS[fmt]) + "\n")
        with pytest.raises(DataError, match=rf"{fmt}.jsonl:1: {fmt} records .*`mindspeed {command}`"):
            tokenize_file(path, "auto", template, tok)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(FORMATS[f]) + "\n" for f in ("messages", "messages", "alpaca")))
    with pytest.raises(DataError, match=r"mixed.jsonl:3: a alpaca record \(keys instruction and output\) "
                                        r"in a file whose first record is messages"):  # fmt: skip
        tokenize_file(mixed, "auto", template, tok)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"unknown.jsonl:1: .*cannot tell.*\['answer', 'question'\]"):
        tokenize_file(unknown, "auto", template, tok)


def test_preference_loaders_name_the_command_of_other_records(tmp_path):
    """`mindspeed dpo` on KTO records, `kto` on pairs, `prm` on chat data: one line naming
    the file, the line and the command that trains them."""
    from mindspeed_llm.data.sft_records import read_records

    for fmt, expect, command in (("unpaired", "pairwise", "kto"), ("pairwise", "unpaired", "dpo"),
                                 ("messages", "stepwise", "sft")):  # fmt: skip
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(FORMATS[fmt]) + "\n")
        with pytest.raises(DataError, match=rf"{fmt}.jsonl:1: {fmt} records .* not {expect} ones: .*`mindspeed {command}`"):
            list(read_records(path, expect=expect))
        assert len(list(read_records(path))) == 1


def _samples(n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(5, 14))
        ids = rng.integers(4, 200, length)
        labels = np.where(rng.random(length) < 0.5, ids, IGNORE_INDEX)
        labels[-1] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _loss_and_grads(model, batch):
    model.zero_grad()
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    labels = batch["labels"].flatten()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
    ) / (labels != IGNORE_INDEX).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_equals_padded():
    from mindspeed_llm.models import build_model_config, get_model_spec

    config = build_model_config("llama", "debug", ops_impl="reference")
    torch.manual_seed(0)
    model = get_model_spec("llama").build(config).float()
    samples = _samples()
    rows = pack_rows([len(s[0]) for s in samples], 32)
    assert len(rows) < len(samples) and all(sum(len(samples[i][0]) for i in r) <= 32 for r in rows)
    packed = collate_rows([[samples[i] for i in r] for r in rows], 32, pad_id=0)
    padded = collate_rows([[s] for s in samples], 16, pad_id=0)
    for batch in (packed, padded):
        check_batch(batch)
    # each sample is its own document, positions from 0; padding is one more document
    assert packed["position_ids"][0, : len(samples[0][0])].tolist() == list(range(len(samples[0][0])))
    assert len(packed["cu_seqlens"]) - 1 >= len(samples) + 1
    loss_p, grads_p = _loss_and_grads(model, packed)
    loss_d, grads_d = _loss_and_grads(model, padded)
    torch.testing.assert_close(loss_p, loss_d, atol=1e-5, rtol=1e-5)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grad, grads_d[name], atol=1e-5, rtol=1e-5, msg=name)


def test_preprocess_prefix_and_parquet_give_the_raw_samples(tmp_path):
    """MindSpeed-LLM's file names (`P_packed_{input_ids,attention_mask,labels}_document`,
    labels aligned with the ids) read back as the samples of the raw file; `--neat-pack`
    rows split into their samples; parquet reads like jsonl."""
    from mindspeed_llm.data import IndexedDatasetWriter
    from mindspeed_llm.data.sft import read_prefix
    from mindspeed_llm.data.sft_records import read_records

    folder = make_folder(tmp_path / "tok", TEMPLATES["chatml"])
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    rows = [{"instruction": f"user {i} asks", "output": f"answers {i}"} for i in range(3)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw, _ = tokenize_file(jsonl, "alpaca", template, tok)
    aligned = [(ids, np.concatenate([[IGNORE_INDEX], labels[:-1]])) for ids, labels in raw]
    for prefix, neat in ((tmp_path / "p", False), (tmp_path / "n", True)):
        writers = {k: IndexedDatasetWriter(f"{prefix}_packed_{k}_document")
                   for k in ("input_ids", "attention_mask", "labels")}  # fmt: skip
        docs = [aligned] if neat else [[s] for s in aligned]  # neat: all in one row
        for doc in docs:
            mask = np.concatenate([np.full(len(ids), n + 1) for n, (ids, _) in enumerate(doc)])
            writers["input_ids"].add_document(np.concatenate([d[0] for d in doc]))
            writers["labels"].add_document(np.concatenate([d[1] for d in doc]))
            writers["attention_mask"].add_document(mask if neat else np.ones_like(mask))
        for w in writers.values():
            w.finalize()
        samples, stats = read_prefix(prefix)
        assert stats.samples == 3
        for (ids, labels), (raw_ids, raw_labels) in zip(samples, raw, strict=True):
            assert ids.tolist() == raw_ids.tolist() and labels.tolist() == raw_labels.tolist()
    with pytest.raises(DataError, match="_packed_input_ids_document"):
        read_prefix(tmp_path / "missing")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    assert [r for _, r in read_records(tmp_path / "a.parquet")] == rows
    assert [w for w, _ in read_records(jsonl)][1].endswith("a.jsonl:2")


TOOL_CALL = [
    {"role": "user", "content": "what is 6 times 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "multiply", "arguments": "{\"a\": 6, \"b\": 7}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    {"role": "assistant", "content": "6 times 7 is 42."},
]  # fmt: skip
"""OpenAI's standard tool-call record: the calling turn has content null."""


def test_openai_tool_call_records_train_through_the_templates_tool_format(tmp_path):
    """A template that renders tool calls (Qwen2.5's) trains the call as Hugging Face renders
    it; one that does not (our ChatML) refuses the record by name, and the summary says
    the template refused it (not "without an assistant reply")."""
    from pathlib import Path

    qwen = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen.jinja").read_text()
    folder = make_folder(tmp_path / "qwen", qwen)
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"messages": TOOL_CALL}) + "\n")
    samples, stats = tokenize_file(path, "auto", template, tok, cache_dir=tmp_path / "c")
    assert (stats.samples, stats.refused, stats.bad) == (1, 0, 0), stats
    supervised = tok.decode([int(t) for t in samples[0][1] if t != IGNORE_INDEX])
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>' in supervised
    assert "6 times 7 is 42." in supervised and "42\n</tool_response>" not in supervised
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    as_hf = json.loads(json.dumps(TOOL_CALL))  # transformers wants arguments as an object
    as_hf[1]["tool_calls"][0]["function"]["arguments"] = {"a": 6, "b": 7}
    ours = template.render(record_messages({"messages": TOOL_CALL}, "messages"))
    assert ours == hf.apply_chat_template(as_hf, tokenize=False)

    chatml = make_folder(tmp_path / "chatml", TEMPLATES["chatml"])
    tok, template = load_tokenizer(chatml), load_chat_template(chatml)
    with pytest.raises(DataError, match=r"calls.jsonl:1: chat template .* \(on a conversation with "
                                        r"tool calls: does the template render them\?\)"):  # fmt: skip
        tokenize_file(path, "auto", template, tok, cache_dir=tmp_path / "c", strict=True)
    _, stats = tokenize_file(path, "auto", template, tok, cache_dir=tmp_path / "c")
    assert (stats.samples, stats.refused, stats.no_reply) == (0, 1, 0)
    assert "skipped 1 refused by the chat template (" in stats.line() and "calls.jsonl:1" in stats.line()
