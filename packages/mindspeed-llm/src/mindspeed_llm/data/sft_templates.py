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
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
}
"""name -> Jinja source."""

# The special tokens each format writes, for tokenizers whose folder does not name them.
_SPECIALS: dict[str, dict[str, str]] = {}


def named_template(name: str, folder: str | os.PathLike | None = None) -> ChatTemplate:
    """The template called `name`, with the special tokens of the tokenizer `folder`.

    Raises:
        ConfigError: no template has that name.
    """
    if name not in TEMPLATES:
        raise ConfigError(
            f"data.chat_template={name!r} is not a template name ({', '.join(sorted(TEMPLATES))}) "
            "nor a .jinja file"
        )
    specials = dict(_SPECIALS.get(name, {}))
    if folder is not None:
        path = Path(folder)
        specials.update(_special_tokens(path if path.is_dir() else path.parent))
    return ChatTemplate(TEMPLATES[name], specials, origin=f"built-in {name} template")


def resolve_template(spec: str | None, tokenizer_path: str | os.PathLike) -> ChatTemplate:
    """`data.chat_template`: None -> the tokenizer folder's own template (ChatML when it
    has none); a name -> `named_template`; a path -> that .jinja file or folder."""
    if spec is None:
        return load_chat_template(tokenizer_path)
    if spec in TEMPLATES:
        return named_template(spec, tokenizer_path)
    if Path(spec).exists():
        return load_chat_template(spec)
    return named_template(spec)  # raises, listing the names
