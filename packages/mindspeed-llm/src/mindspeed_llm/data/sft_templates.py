"""Named chat templates: our renderings of the published chat formats, by family.

`data.chat_template NAME` picks one of `TEMPLATES` (MindSpeed-LLM's common names); each
is a short Jinja program that renders system, user, assistant (and where the format has
them, tool) turns exactly as that family's Hugging Face template does, character for
character (`tests/test_sft_templates.py` renders both on the same conversations; the
Hugging Face templates are test fixtures). Tool calls and reasoning fields are left to
the model folder's own template (the default when no name is given).
"""

from __future__ import annotations

import os
from pathlib import Path

from mindspeed_core.errors import ConfigError
from mindspeed_llm.chat_template import ChatTemplate, _special_tokens, load_chat_template

__all__ = ["TEMPLATES", "named_template", "resolve_template"]

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen's tool results: consecutive tool turns share one user turn of <tool_response> blocks.
_QWEN_TOOL = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
)

_QWEN = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}" + _QWEN_TOOL + "{% elif not (loop.first and "
    "message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3: replies after the last real user query show their reasoning in <think> tags
# (an empty block for the final reply); earlier replies lose it.
_QWEN3 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% set ns = namespace(last_query=messages|length - 1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' and not ("
    "message['content'].startswith('<tool_response>') and "
    "message['content'].endswith('</tool_response>')) %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if message['reasoning_content'] is defined %}"
    "{% set reasoning = message['reasoning_content'] %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]"
    ".lstrip('\n') %}{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n'"
    " + content.lstrip('\n') + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'tool' %}" + _QWEN_TOOL + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)

_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set content = message['content'] %}"
    "{% if loop.first and system is not none %}"
    "{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + content %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

_LLAMA3 = (
    "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('the mistral template has only user and assistant turns') }}"
    "{% endif %}{% endfor %}"
)

# DeepSeek-V3: system prompts first; a reply after tool outputs closes them instead of
# opening an assistant turn.
_DEEPSEEK3 = (
    "{{ bos_token }}{{ messages | selectattr('role', 'equalto', 'system')"
    " | map(attribute='content') | join('\n\n') }}"
    "{% set ns = namespace(tool=false, first_output=true) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.tool = false %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜tool▁outputs▁end｜>' if ns.tool else '<｜Assistant｜>' }}"
    "{{ message['content'] + '<｜end▁of▁sentence｜>' }}{% set ns.tool = false %}"
    "{% elif message['role'] == 'tool' %}{% set ns.tool = true %}"
    "{% if ns.first_output %}{{ '<｜tool▁outputs▁begin｜>' }}"
    "{% set ns.first_output = false %}{% else %}{{ '\n' }}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if ns.tool %}{{ '<｜tool▁outputs▁end｜>' }}"
    "{% elif add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_GLM4 = (
    "[gMASK]<sop>{% for message in messages %}{% if message['content'] %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['metadata'] }}{{ '\n' + message['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_GEMMA = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{{ raise_exception('the gemma template has no system turn') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

_PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] in ('user', 'assistant') or (message['role'] == 'system' and "
    "message['content']) %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "qwen": _QWEN,
    "qwen3": _QWEN3,
    "llama2": _LLAMA2,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "deepseek3": _DEEPSEEK3,
    "glm4": _GLM4,
    "gemma": _GEMMA,
    "phi3": _PHI3,
}
"""name -> Jinja source (rendered with transformers' options: trim_blocks, lstrip_blocks)."""

# The special tokens each format writes, for tokenizer folders that do not name them.
_SPECIALS: dict[str, dict[str, str]] = {
    "llama2": {"bos_token": "<s>", "eos_token": "</s>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "deepseek3": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi3": {"eos_token": "<|endoftext|>"},
}


def named_template(
    name: str, folder: str | os.PathLike | None = None, *, field: str = "data.chat_template"
) -> ChatTemplate:
    """The template called `name`, with the special tokens of the tokenizer `folder`.

    Raises:
        ConfigError: no template has that name (the message names `field`).
    """
    if name not in TEMPLATES:
        raise ConfigError(
            f"{field}={name!r} is not a template name ({', '.join(sorted(TEMPLATES))}) "
            "nor a .jinja file"
        )
    specials = dict(_SPECIALS.get(name, {}))
    if folder is not None:
        path = Path(folder)
        specials.update(_special_tokens(path if path.is_dir() else path.parent))
    return ChatTemplate(TEMPLATES[name], specials, origin=f"built-in {name} template")


def resolve_template(
    spec: str | None, tokenizer_path: str | os.PathLike, *, field: str = "data.chat_template"
) -> ChatTemplate:
    """`data.chat_template` (or another `field`): None -> the tokenizer folder's own
    template (ChatML when it has none); a name -> `named_template`; a path -> that
    .jinja file or folder."""
    if spec is None:
        return load_chat_template(tokenizer_path)
    if spec in TEMPLATES:
        return named_template(spec, tokenizer_path)
    if Path(spec).exists():
        return load_chat_template(spec)
    return named_template(spec, field=field)  # raises, listing the names
