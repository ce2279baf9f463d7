"""Named chat templates render every conversation exactly as the family's published
Hugging Face template does, rendered by transformers itself (fixtures/chat_templates/
hold those templates, see SOURCES.md); an unknown name is a one-line config error."""

from pathlib import Path

import pytest

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.data.sft_templates import _SPECIALS, TEMPLATES, named_template, resolve_template

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "  4  "},
    {"role": "user", "content": "\nAnd in German?"},
    {"role": "assistant", "content": "Vier.\n"},
]
TOOL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look."},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "21 degrees and clear."},
]
NO_SYSTEM = {"mistral", "gemma"}  # their templates refuse a system turn
TOOL_TURNS = {"qwen", "qwen3", "chatml", "llama3", "deepseek3", "glm4", "phi3"}


def conversations(name):
    chats = [TURNS[:2], TURNS, TURNS[:3]]
    if name not in NO_SYSTEM:
        chats += [[SYSTEM, *TURNS[:2]], [SYSTEM, *TURNS]]
    if name in TOOL_TURNS:
        chats += [TOOL, [SYSTEM, *TOOL], TOOL[:4]]
    return chats


def hf_render(source, chat, specials, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[chat], chat_template=source, **specials, **kwargs
    )
    return rendered[0]


def test_every_named_template_equals_the_published_one():
    pytest.importorskip("transformers")
    assert sorted(TEMPLATES) == sorted(p.stem for p in FIXTURES.glob("*.jinja"))
    for name in TEMPLATES:
        hf_source = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
        ours = named_template(name)
        specials = dict(_SPECIALS.get(name, {}))
        for chat in conversations(name):
            for gen in (False, True):
                expected = hf_render(hf_source, chat, specials, add_generation_prompt=gen)
                got = ours.render(chat, add_generation_prompt=gen)
                assert got == expected, (name, gen, chat)
    # Qwen3's thinking switch and reasoning field, as the published template reads them
    q3, src = named_template("qwen3"), (FIXTURES / "qwen3.jinja").read_text()
    thinking = [*TURNS[:3], {"role": "assistant", "content": "Vier.", "reasoning_content": "de"}]
    for chat, extra in ((TURNS[:3], {"enable_thinking": False}), (thinking, {})):
        expected = hf_render(src, chat, {}, add_generation_prompt=True, **extra)
        assert q3.render(chat, add_generation_prompt=True, **extra) == expected
    for name in NO_SYSTEM:
        with pytest.raises(DataError):
            named_template(name).render([SYSTEM, *TURNS[:2]])


def test_unknown_template_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"data.chat_template='qwen4'.*chatml.*qwen3"):
        resolve_template("qwen4", tmp_path)
    jinja = tmp_path / "t.jinja"
    jinja.write_text(TEMPLATES["chatml"])
    assert resolve_template(str(jinja), tmp_path).source == TEMPLATES["chatml"]
    assert resolve_template("llama3", tmp_path).special_tokens["bos_token"] == "<|begin_of_text|>"
