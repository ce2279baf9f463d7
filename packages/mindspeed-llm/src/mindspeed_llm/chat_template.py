"""Hugging Face chat templates: load one from a model folder, render it like transformers.

A chat template is a Jinja program that turns `messages` (`[{"role": ..., "content": ...}]`)
into the prompt text a chat model was trained on. `load_chat_template(path)` finds it where
transformers does: `chat_template.jinja` (plus `additional_chat_templates/*.jinja`) in the
folder, else `tokenizer_config.json`'s `"chat_template"` (a string, or a list of
`{"name", "template"}`). `ChatTemplate.render` renders it in the same sandboxed Jinja
environment as `transformers`' `apply_chat_template(tokenize=False)`, so the text is the
same character for character.

A folder without a template gets `FALLBACK_TEMPLATE` (ChatML, as used by Qwen:
`<|im_start|>{role}\\n{content}<|im_end|>\\n`), and `ChatTemplate.is_fallback` says so.

`encode_chat` tokenizes a conversation for supervised fine-tuning: it returns the token
ids and labels where every token outside an assistant reply is -100.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from mindspeed_core.errors import DataError
from mindspeed_core.files import read_text

__all__ = [
    "FALLBACK_TEMPLATE",
    "IGNORE_INDEX",
    "ChatTemplate",
    "TemplateDefect",
    "encode_chat",
    "encode_text",
    "load_chat_template",
]

IGNORE_INDEX = -100
"""The label of a token the loss leaves out (prompt tokens in SFT)."""

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, for folders without a chat template of their own."""

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to.

    Attributes:
        source: the Jinja text.
        special_tokens: `{"bos_token": "<s>", "eos_token": "</s>", ...}`, passed to the
            template as variables, as transformers does.
        origin: where the template came from (a file, or "built-in ChatML fallback").
        is_fallback: True when the folder had no template and ChatML is used.
    """

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    origin: str = "<string>"
    is_fallback: bool = False

    def __post_init__(self):
        import jinja2

        try:  # a broken template fails here, once, not at every conversation
            _compile(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise DataError(
                f"chat template {self.origin} has a syntax error at line {err.lineno}: {err}"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text of `messages`, as `apply_chat_template(tokenize=False)` renders it.

        Keys whose value is None are dropped from each message first (transformers does
        too: many templates print "None" otherwise), and a reply's reasoning is passed
        under both names templates read (`reasoning_content`, `thinking`). Extra `variables` (e.g.
        `enable_thinking=False`) reach the template and win over the special tokens.

        Raises:
            DataError: the messages are not a list of dicts, or the template refuses them
                (`raise_exception`) or fails; the message names the template's origin.
        """
        import jinja2
        import jinja2.sandbox

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise DataError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise DataError(f"chat message {i} must be a dict, got {message!r:.80}")
            chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
        context = {**self.special_tokens, **variables}
        try:
            with _time_limit(RENDER_SECONDS):
                return _compile(self.source).render(
                    messages=chat,
                    tools=list(tools) if tools is not None else None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **context,
                )
        except (OverflowError, MemoryError, RecursionError, _Expired) as err:
            raise TemplateDefect(
                f"chat template {self.origin} is unsafe to run: {_why(err)}"
            ) from None
        except jinja2.sandbox.SecurityError as err:
            raise TemplateDefect(f"chat template {self.origin} is unsafe to run: {err}") from None
        except jinja2.TemplateError as err:
            raise TemplateRefusal(f"chat template {self.origin}: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise TemplateRefusal(f"chat template {self.origin} failed: {err!r}") from None


class TemplateDefect(DataError):
    """The template itself cannot run (too big a range or product, too long, too deep),
    whatever the conversation: unlike a template's own `raise_exception`, not a turn to skip."""


class TemplateRefusal(DataError):
    """The template raised on this conversation (its `raise_exception`, or a field it reads
    that the conversation lacks): the conversation is skipped, named by the template's error."""


RENDER_SECONDS = 10.0
"""Longest a template may run for one conversation (templates take milliseconds)."""
_MAX_PRODUCT = 10_000_000  # characters or items a `*` in a template may make
_MAX_EXPONENT = 1_000


class _Expired(Exception):
    pass


def _why(err: BaseException) -> str:
    if isinstance(err, _Expired):
        return f"it ran for more than {RENDER_SECONDS:g} s"
    if isinstance(err, RecursionError):
        return "it recursed too deep"
    return str(err) or err.__class__.__name__


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise `_Expired` in this thread after `seconds`: by SIGALRM in the main thread, and
    in any other (a server renders off its event loop) by an asynchronous exception that a
    timer thread sets for it, which Python raises at the thread's next bytecode (a template
    is Python code compiled by Jinja)."""
    if threading.current_thread() is not threading.main_thread():
        with _thread_time_limit(seconds):
            yield
        return
    if not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _thread_time_limit(seconds: float):
    import ctypes

    ident, lock, state = threading.get_ident(), threading.Lock(), {"open": True, "fired": False}

    def raise_in(exc) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)

    def expire() -> None:
        with lock:
            if state["open"]:
                state["fired"] = True
                raise_in(ctypes.py_object(_Expired))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            state["open"] = False
            if state["fired"]:  # set but perhaps not raised yet: it must not escape later
                raise_in(None)
        timer.cancel()


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """Fill `reasoning_content` and `thinking` from any reasoning field, as transformers does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def _compile(source: str):
    """A compiled template in transformers' sandbox: same globals, filters and options."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers'
        # assistant masks; rendering only needs its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        # `'x' * 10**10` or `2 ** 10**9` would exhaust memory or CPU in one step, where the
        # time limit cannot interrupt; transformers' sandbox allows them, we refuse.
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
                raise jinja2.sandbox.SecurityError(f"exponent {right} is too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    sized = isinstance(seq, str | list | tuple) and isinstance(n, int)
                    if sized and len(seq) * n > _MAX_PRODUCT:
                        raise jinja2.sandbox.SecurityError(
                            f"{type(seq).__name__} * {n} makes more than {_MAX_PRODUCT} items"
                        )
            return super().call_binop(context, operator, left, right)

    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def load_chat_template(
    path: str | os.PathLike | None, name: str | None = None, *, fallback: bool = True
) -> ChatTemplate:
    """The chat template of a model or tokenizer folder (or of a file in one).

    `path` may be the folder, a `.jinja` file, `tokenizer_config.json`, or a tokenizer
    file (`tokenizer.json`, `*.model`) whose folder is searched. `name` picks one of
    several named templates (default: "default"). Without a template in the folder,
    `fallback=True` gives ChatML (`is_fallback=True`), `fallback=False` raises.

    Raises:
        DataError: the path does not exist, a config file is not valid JSON, the named
            template does not exist, or there is none and `fallback` is False.
    """
    if path is None:
        return ChatTemplate(FALLBACK_TEMPLATE, origin="built-in ChatML fallback", is_fallback=True)
    p = Path(path)
    if not p.exists():
        raise DataError(f"chat template path does not exist: {p}")
    if p.is_file() and p.suffix == ".jinja":
        return ChatTemplate(_read(p), _special_tokens(p.parent), origin=str(p))
    folder = p if p.is_dir() else p.parent
    templates = _find_templates(folder)
    specials = _special_tokens(folder)
    if not templates:
        if not fallback:
            raise DataError(f"no chat template in {folder}")
        return ChatTemplate(
            FALLBACK_TEMPLATE, specials, origin="built-in ChatML fallback", is_fallback=True
        )
    if name is None:
        name = "default"
        if name not in templates and len(templates) > 1:
            raise DataError(
                f"{folder} has several chat templates and none named 'default': "
                f"choose one of {sorted(templates)}"
            )
        name = name if name in templates else next(iter(templates))
    if name not in templates:
        raise DataError(f"no chat template named {name!r} in {folder}: have {sorted(templates)}")
    source, origin = templates[name]
    return ChatTemplate(source, specials, origin=origin)


def _find_templates(folder: Path) -> dict[str, tuple[str, str]]:
    """{name: (source, origin)}; the .jinja files win over tokenizer_config.json, as in transformers."""
    found: dict[str, tuple[str, str]] = {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        found["default"] = (_read(jinja), str(jinja))
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            found[file.stem] = (_read(file), str(file))
    if found:
        return found
    config_path = folder / "tokenizer_config.json"
    template = _read_json(config_path).get("chat_template") if config_path.is_file() else None
    if isinstance(template, str):
        return {"default": (template, f"{config_path}:chat_template")}
    if isinstance(template, list):
        for i, entry in enumerate(template):
            if not (isinstance(entry, dict) and {"name", "template"} <= entry.keys()):
                raise DataError(f"{config_path}: chat_template[{i}] needs 'name' and 'template'")
            found[entry["name"]] = (entry["template"], f"{config_path}:chat_template[{i}]")
        return found
    if template is not None:
        raise DataError(
            f"{config_path}: chat_template must be a string or a list, got {type(template).__name__}"
        )
    return {}


def _special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens of the folder's config files, as template variables."""
    tokens: dict[str, str] = {}
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / filename
        if not path.is_file():
            continue
        config = _read_json(path)
        for key in _SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):  # a serialised AddedToken
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
    return tokens


def _read(path: Path) -> str:
    return read_text(path)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(_read(path))
    except ValueError as err:
        raise DataError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} must hold a JSON object")
    return value


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of rendered template text, special tokens written in it included.

    Hugging Face tokenizers recognise their added tokens (`<|im_start|>`) in text by
    themselves; a sentencepiece model does not, so for it the text is split on the
    tokenizer's special pieces (e.g. `<s>`, `</s>`) and those map to their ids.
    """
    from mindspeed_llm.tokenizer import HFTokenizer

    if isinstance(tokenizer, HFTokenizer) or not text:
        return tokenizer.encode(text)
    specials = tokenizer.special_tokens
    pattern = _special_pattern(tuple(sorted(specials, key=len, reverse=True)))
    if pattern is None:
        return tokenizer.encode(text)
    ids: list[int] = []
    for i, part in enumerate(pattern.split(text)):
        if i % 2:
            ids.append(specials[part])
        elif part:
            ids.extend(tokenizer.encode(part))
    return ids


@lru_cache(maxsize=8)
def _special_pattern(pieces: tuple[str, ...]) -> re.Pattern | None:
    pieces = tuple(p for p in pieces if p)
    return re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None


def encode_chat(
    template: ChatTemplate,
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    train_roles: tuple[str, ...] = ("assistant",),
    **variables: Any,
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation; labels are -100 outside assistant replies.

    Each reply's span is found by rendering: the conversation up to the reply with the
    generation prompt ends where the reply starts, the conversation through the reply
    ends where it stops. Prompt and reply texts are tokenized apart (as MindSpeed-LLM and
    LLaMA-Factory do), so a label mask never cuts a token in two.

    A reply is trained only where the whole conversation shows it exactly as the model
    would generate it after its prompt. Templates that render past turns differently
    (Qwen3 drops past reasoning and think tags; some Mistral templates move the system
    prompt into the last user turn) thus train the turns they keep as generated (the
    last one, usually); the others stay in the prompt.

    Raises:
        DataError: the conversation has no reply to learn from.
    """
    full = template.render(messages, **variables)
    cuts: list[tuple[int, int]] = []
    replies = 0
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in train_roles:
            continue
        replies += 1
        before = template.render(messages[:i], add_generation_prompt=True, **variables)
        through = template.render(messages[: i + 1], **variables)
        done = cuts[-1][1] if cuts else 0
        if through.startswith(before) and full.startswith(through) and len(before) >= done:
            cuts.append((len(before), len(through)))
    if not cuts:
        raise DataError(
            f"conversation has no {'/'.join(train_roles)} message to train on"
            if not replies
            else f"chat template {template.origin} renders no reply as generated; "
            "nothing to train on"
        )
    ids: list[int] = []
    labels: list[int] = []
    position = 0
    for start, stop in cuts:
        prompt = encode_text(tokenizer, full[position:start])
        reply = encode_text(tokenizer, full[start:stop])
        ids += prompt + reply
        labels += [IGNORE_INDEX] * len(prompt) + reply
        position = stop
    tail = encode_text(tokenizer, full[position:])
    ids += tail
    labels += [IGNORE_INDEX] * len(tail)
    return ids, labels
