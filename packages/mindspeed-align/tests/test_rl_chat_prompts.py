"""RL prompts as chat: {"messages": [...]} records (and, with `data.chat_template`,
{"prompt": ...} records as one user turn) are rendered with the generation prompt exactly
as transformers renders each named template's published source; the rendered prompt is
what the sampler continues; `mindspeed grpo` trains on such a file, ground-truth columns
reaching the reward; bad chat records are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_align.rl.cli import main
from mindspeed_align.rl.data import PromptSource, read_prompts, render_prompts
from mindspeed_core.cli import guarded
from mindspeed_core.training import read_metrics
from mindspeed_llm.chat_template import encode_text
from mindspeed_llm.data.sft_templates import TEMPLATES, named_template
from mindspeed_llm.demo import ensure_demo_data
from mindspeed_llm.tokenizer import load_tokenizer

# the published Hugging Face templates (see that folder's SOURCES.md)
FIXTURES = Path(__file__).parents[2] / "mindspeed-llm" / "tests" / "fixtures" / "chat_templates"
SYSTEM = {"role": "system", "content": "Answer with a number."}
ASK = {"role": "user", "content": "Ann had 2 apples and Bob had 3. How many in all?"}
MULTI = [ASK, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 more?"}]
NO_SYSTEM = {"mistral", "gemma"}  # their templates refuse a system turn


def _hf_render(source: str, chat: list, specials: dict) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[chat], chat_template=source, add_generation_prompt=True, **specials
    )
    return rendered[0]


def test_chat_prompts_render_as_transformers_renders_each_named_template():
    pytest.importorskip("transformers")
    for name in TEMPLATES:
        template = named_template(name)
        source = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
        chats = [[ASK], MULTI] + ([] if name in NO_SYSTEM else [[SYSTEM, ASK]])
        records = [{"messages": chat, "answer": 5} for chat in chats]
        records.append({"prompt": ASK["content"], "answer": 5})  # a plain prompt: one user turn
        render_prompts(records, template, source="test")
        for record, chat in zip(records, [*chats, [ASK]], strict=True):
            expected = _hf_render(source, chat, dict(template.special_tokens))
            assert record["prompt"] == expected, (name, chat)
            assert record["answer"] == 5  # ground truth passes through


def test_the_sampler_continues_the_rendered_prompt():
    tokenizer = load_tokenizer(ensure_demo_data().tokenizer)
    records = [{"messages": [SYSTEM, ASK], "answer": 5}]
    render_prompts(records, named_template("chatml"), source="test")
    source = PromptSource(records, tokenizer, max_prompt_len=200, prompts_per_step=1, seed=0)
    picked = source.next_step()[0]
    assert picked["prompt"].endswith("<|im_start|>assistant\n")
    assert picked["prompt_ids"] == encode_text(tokenizer, picked["prompt"])


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    from mindspeed_align.rl.data import demo_records

    folder = tmp_path_factory.mktemp("chat")
    path = folder / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in demo_records(24, seed=3)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, path


def _args(folder: Path, prompts: Path, *extra: str) -> list[str]:
    return [
        f"--data.prompts={prompts}", f"--data.tokenizer={ensure_demo_data().tokenizer}",
        "--data.eval_prompts=4", "--data.seq_len=96", "--grpo.n=2", "--grpo.max_new_tokens=3",
        "--grpo.reward_workers=0", "--train.global_batch=8", "--train.micro_batch=8",
        "--train.steps=2", "--model.ops_impl=reference", f"--logging.run_dir={folder / 'run'}",
        "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
        *extra,
    ]  # fmt: skip


def test_grpo_trains_on_chat_records(chat_file, capsys):
    folder, path = chat_file
    assert guarded(main, _args(folder, path, "--data.chat_template=chatml")) == 0
    captured = capsys.readouterr()
    assert "prompts rendered by the chat template built-in chatml template" in (
        captured.err + captured.out
    )
    metrics = read_metrics(folder / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)  # final_number read "answer"


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"messages": [{"role": "system", "content": "hi"}], "answer": 1},
         "bad.jsonl:2: the messages have no user turn"),
        ({"messages": "hello", "answer": 1}, 'bad.jsonl:2: "messages" must be a non-empty list'),
        ({"messages": [{"role": "user"}], "answer": 1},
         'bad.jsonl:2: messages[0] needs a "role" and a "content" string'),
        ({"question": "2+2?", "answer": 4},
         'bad.jsonl:2: a record needs a "prompt" string or a "messages" list'),
    ],
)  # fmt: skip
def test_bad_chat_records_are_one_line(tmp_path, capsys, record, expected):
    good = {"messages": [ASK], "answer": 5}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(Exception, match="bad.jsonl:2"):
        read_prompts(path)
    assert guarded(main, _args(tmp_path, path)) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
