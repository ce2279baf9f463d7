"""Chat templates render exactly what transformers' apply_chat_template renders."""

import json

import pytest

from mindspeed_core.errors import DataError
from mindspeed_llm.chat_template import (
    FALLBACK_TEMPLATE,
    IGNORE_INDEX,
    ChatTemplate,
    encode_chat,
    encode_text,
    load_chat_template,
)
from mindspeed_llm.tokenizer import load_tokenizer, train_sentencepiece

# Qwen2.5-Instruct's template (tools branch shortened), written with `{%-` blocks.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3-Instruct's template (one line, bos_token, trim filter).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Mistral/Llama-2 style: plain `{%` blocks on indented lines (trim_blocks, lstrip_blocks
# matter), raise_exception, bos/eos tokens.
MISTRAL = """{{ bos_token -}}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' -}}
    {% elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token -}}
    {% endif %}
{% endfor %}
"""

# Qwen3's template (tool calls left out): past replies lose their think block.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Features from Llama-3.1/SmolLM/Qwen3 templates: namespace, loop controls, strftime_now,
# tojson(indent), the {% generation %} tag, tools, extra variables (enable_thinking).
FEATURES = """{%- set ns = namespace(last_user=-1, n=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token + 'Today: ' + strftime_now('%d %b %Y') + '\\n' }}
{%- if tools %}{{- tools | tojson(indent=4) + '\\n' }}{% endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if m.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n' }}
        {%- generation %}{{ m.content | trim }}{% if loop.index0 > ns.last_user and not enable_thinking | default(true) %} (no think){% endif %}<|eot_id|>{% endgeneration %}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n' + m.content + '<|eot_id|>' }}
    {%- endif %}
    {%- if ns.n > 3 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n' }}{% endif %}
"""

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
SPECIALS += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEXTS = [
    f"user {i} asks about {w} and the café 你好 answers {i * 7}"
    for i in range(30)
    for w in ("apples", "rivers", "tools")
]

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4  "},
        {"role": "user", "content": "Und 你好 🙂?"},
        {"role": "assistant", "content": "Hallo.", "tool_calls": None},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a+b <é>",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


def make_folder(path, template, *, as_jinja=False, bos="<s>", eos="</s>"):
    """A Hugging Face tokenizer folder: tokenizer.json + tokenizer_config.json (+ .jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": bos, "special": True} if bos else None,
        "eos_token": eos,
        "unk_token": "<unk>",
    }
    if as_jinja:
        (path / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def hf_render(folder, chat, **kwargs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok.apply_chat_template(chat, tokenize=False, **kwargs)


@pytest.mark.parametrize(
    "template, as_jinja, bos",
    [(QWEN25, False, None), (LLAMA3, True, "<|begin_of_text|>"), (MISTRAL, False, "<s>")],
    ids=["qwen25-config", "llama3-jinja", "mistral-config"],
)
def test_render_matches_transformers(tmp_path, template, as_jinja, bos):
    folder = make_folder(tmp_path / "tok", template, as_jinja=as_jinja, bos=bos)
    ours = load_chat_template(folder)
    assert not ours.is_fallback and ours.source == template
    chats = CHATS if template is not MISTRAL else [CHATS[0], CHATS[1][1:]]  # no system role
    for chat in chats:
        for gen in (False, True):
            expected = hf_render(folder, chat, add_generation_prompt=gen)
            assert ours.render(chat, add_generation_prompt=gen) == expected
    if template is QWEN25:
        expected = hf_render(folder, CHATS[1], tools=TOOLS)
        assert ours.render(CHATS[1], tools=TOOLS) == expected
        assert '"description": "a+b <é>"' in expected  # tojson: no HTML escaping, no ascii
    # loading through a tokenizer file in the folder finds the same template
    assert load_chat_template(folder / "tokenizer.json").source == template


def test_template_features_match_transformers(tmp_path):
    folder = make_folder(tmp_path / "f", FEATURES, as_jinja=True, bos="<|begin_of_text|>")
    ours = load_chat_template(folder)
    long_chat = CHATS[1] + [
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "x"},
    ]
    for chat in (CHATS[1], long_chat):
        for extra in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
            for gen in (False, True):
                expected = hf_render(folder, chat, add_generation_prompt=gen, **extra)
                assert ours.render(chat, add_generation_prompt=gen, **extra) == expected
    assert "(no think)" in ours.render(CHATS[1], enable_thinking=False)
    # reasoning under any of its names reaches templates reading either name
    reads = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}"
    folder = make_folder(tmp_path / "r", reads)
    chat = [
        {"role": "assistant", "content": "a", "reasoning": "why"},
        {"role": "assistant", "content": "b", "thinking": "how", "reasoning_content": None},
    ]
    assert load_chat_template(folder).render(chat) == hf_render(folder, chat) == "why|why;how|how;"


def test_raise_exception_and_bad_templates(tmp_path):
    folder = make_folder(tmp_path / "m", MISTRAL)
    template = load_chat_template(folder)
    bad = [{"role": "assistant", "content": "x"}]
    with pytest.raises(DataError, match=r"tokenizer_config.json:chat_template: Conversation roles"):
        template.render(bad)
    with pytest.raises(DataError, match=r"chat template <string> has a syntax error at line 1"):
        ChatTemplate("{% for %}")
    (tmp_path / "bad.jinja").write_text("{{ messages }\n")
    with pytest.raises(DataError, match=r"bad.jinja has a syntax error at line 1"):
        load_chat_template(tmp_path / "bad.jinja")
    with pytest.raises(DataError, match="message 0 must be a dict"):
        template.render(["hello"])


def test_named_templates_fallback_and_errors(tmp_path):
    folder = make_folder(
        tmp_path / "n",
        [{"name": "default", "template": LLAMA3}, {"name": "tool_use", "template": QWEN25}],
    )
    assert load_chat_template(folder).source == LLAMA3
    assert load_chat_template(folder, "tool_use").source == QWEN25
    with pytest.raises(DataError, match=r"no chat template named 'rag'.*\['default', 'tool_use'\]"):
        load_chat_template(folder, "rag")
    plain = make_folder(tmp_path / "plain", None)
    fallback = load_chat_template(plain)
    assert fallback.is_fallback and fallback.source == FALLBACK_TEMPLATE
    assert fallback.render(CHATS[0], add_generation_prompt=True) == (
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(DataError, match="no chat template in"):
        load_chat_template(plain, fallback=False)
    with pytest.raises(DataError, match="does not exist"):
        load_chat_template(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(DataError, match=r"broken/tokenizer_config.json is not valid JSON"):
        load_chat_template(tmp_path / "broken")


def test_encode_chat_masks_everything_but_replies(tmp_path):
    folder = make_folder(tmp_path / "q", QWEN25)
    template, tok = load_chat_template(folder), load_tokenizer(folder)
    ids, labels = encode_chat(template, tok, CHATS[1])
    assert len(ids) == len(labels)
    assert tok.decode(ids) == tok.decode(encode_text(tok, template.render(CHATS[1])))
    replies = [ids[i] for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert [labels[i] for i, label in enumerate(labels) if label != IGNORE_INDEX] == replies
    # the supervised text is each reply and its end marker, nothing of the prompt
    im_end = tok.token_to_id("<|im_end|>")
    assert replies.count(im_end) == 2
    text = tok.decode([i for i in replies if i != im_end])
    assert text == "  4  \nHallo.\n"
    with pytest.raises(DataError, match="no assistant message"):
        encode_chat(template, tok, CHATS[0])


def test_qwen3_trains_only_replies_rendered_as_generated(tmp_path):
    folder = make_folder(tmp_path / "q3", QWEN3)
    template, tok = load_chat_template(folder), load_tokenizer(folder)
    thinking = [*CHATS[1][:4], {"role": "assistant", "content": "Hallo.", "reasoning": "why"}]
    for chat in (CHATS[1], thinking):
        for extra in ({}, {"enable_thinking": False}):
            for gen in (False, True):
                expected = hf_render(folder, chat, add_generation_prompt=gen, **extra)
                assert template.render(chat, add_generation_prompt=gen, **extra) == expected
    # the past reply ("  4  ") is rendered without the think block the model would
    # generate before it: it stays prompt; the last reply (with its think block) is trained
    ids, labels = encode_chat(template, tok, thinking)
    trained = [i for i in labels if i != IGNORE_INDEX]
    assert tok.decode(trained) == "<think>\nwhy\n</think>\n\nHallo.\n"  # <|im_end|> is special
    assert trained.count(tok.token_to_id("<|im_end|>")) == 1
    assert tok.decode(ids) == tok.decode(encode_text(tok, template.render(thinking)))
    single = encode_chat(template, tok, CHATS[1][1:3])[1]
    assert tok.decode([i for i in single if i != IGNORE_INDEX]) == "<think>\n\n</think>\n\n  4  \n"


def test_encode_text_maps_special_pieces_for_sentencepiece(tmp_path):
    sp = load_tokenizer(train_sentencepiece(TEXTS, tmp_path / "sp", 300))
    template = ChatTemplate(MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"})
    ids, labels = encode_chat(template, sp, CHATS[1][1:])
    assert ids[0] == sp.bos_id and ids.count(sp.eos_id) == 2
    assert template.render(CHATS[1][1:]) == (
        "<s>[INST] What is 2+2? [/INST]  4  </s>[INST] Und 你好 🙂? [/INST]Hallo.</s>"
    )
    replies = [i for i in labels if i != IGNORE_INDEX]
    assert replies == sp.encode("  4  ") + [sp.eos_id] + sp.encode("Hallo.") + [sp.eos_id]
    assert ids[1 : 1 + len(sp.encode("[INST] What is 2+2? [/INST]"))] == sp.encode(
        "[INST] What is 2+2? [/INST]"
    )


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("{% for i in range(100000000) %}x{% endfor %}", "Range too big"),
        (
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            "ran for more than 0.5 s",
        ),
        ("{{ 'x' * 10000000000 }}", "str * 10000000000 makes more than"),
        ("{{ 2 ** 100000000 }}", "exponent 100000000 is too large"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deep"),
    ],
)
def test_templates_that_cannot_run_are_refused_in_bounded_time(body, why, monkeypatch):
    import mindspeed_llm.chat_template as chat_template

    if "ran for more than" in why:  # the others must fail on their own check, not the clock,
        monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)  # even on a slow machine
    template = ChatTemplate(body, origin="evil.jinja")
    with pytest.raises(chat_template.TemplateDefect, match="evil.jinja is unsafe to run") as err:
        template.render([{"role": "user", "content": "hi"}])
    assert why in str(err.value)
