"""Handlers: one raw record in, the token arrays of its output datasets out.

A handler is named as in MindSpeed-LLM's `preprocess_data.py --handler-name` (the short
names work too) and knows the output keys it writes:

| handler                                        | record                                    | keys                        |
|------------------------------------------------|-------------------------------------------|-----------------------------|
| `pretrain` / `GeneralPretrainHandler`          | `--json-keys` text fields (default text)  | one per json key            |
| `alpaca` / `AlpacaStyleInstructionHandler`     | instruction, input, output, system, history | input_ids, attention_mask, labels |
| `sharegpt` / `SharegptStyleInstructionHandler` | conversations [{from, value}], system, tools | input_ids, attention_mask, labels |
| `messages` (OpenAI)                            | messages [{role, content}], tools         | input_ids, attention_mask, labels |
| `pairwise` / `AlpacaStylePairwiseHandler`      | prompt (or instruction/input), chosen, rejected | chosen_/rejected_ input_ids, labels |
| `SharegptStylePairwiseHandler` (the same)      | conversations or messages, chosen, rejected | chosen_/rejected_ input_ids, labels |

Instruction and pairwise records are rendered with the tokenizer folder's chat template
(`mindspeed_llm.chat_template`); labels are -100 on every token outside the assistant
replies. Handlers run in worker processes: they hold the tokenizer and template and
raise `RecordError` for a record they cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mindspeed_core.errors import DataError
from mindspeed_llm.chat_template import ChatTemplate, TemplateDefect, encode_chat

__all__ = ["HANDLERS", "Handler", "RecordError", "canonical_handler", "output_keys"]


class RecordError(DataError):
    """One input record is unusable (missing key, wrong type, broken JSON)."""


_ALIASES = {
    "pretrain": "pretrain",
    "GeneralPretrainHandler": "pretrain",
    "alpaca": "alpaca",
    "AlpacaStyleInstructionHandler": "alpaca",
    "sharegpt": "sharegpt",
    "SharegptStyleInstructionHandler": "sharegpt",
    "messages": "messages",
    "openai": "messages",
    "pairwise": "pairwise",
    "AlpacaStylePairwiseHandler": "pairwise",
    "SharegptStylePairwiseHandler": "pairwise",
}
HANDLERS = tuple(sorted(_ALIASES))
SFT_KEYS = ("input_ids", "attention_mask", "labels")
PAIRWISE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")

# MindSpeed-LLM's default --map-keys per handler (LLaMA-Factory's column names).
DEFAULT_MAP_KEYS: dict[str, dict[str, Any]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    },
    "sharegpt": {
        "messages": "conversations",
        "system": "system",
        "tools": "tools",
        "tags": {
            "role_tag": "from",
            "content_tag": "value",
            "user_tag": "human",
            "assistant_tag": "gpt",
            "system_tag": "system",
            "observation_tag": "observation",
            "function_tag": "function_call",
        },
    },
    "messages": {
        "messages": "messages",
        "system": "system",
        "tools": "tools",
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
            "system_tag": "system",
            "observation_tag": "tool",
            "function_tag": "function_call",
        },
    },
    "pairwise": {
        "prompt": "prompt",
        "query": "input",
        "system": "system",
        "chosen": "chosen",
        "rejected": "rejected",
    },
}


def canonical_handler(name: str) -> str | None:
    """The short name of a handler (`alpaca` for `AlpacaStyleInstructionHandler`), or None."""
    return _ALIASES.get(name)


def output_keys(handler: str, json_keys: tuple[str, ...]) -> tuple[str, ...]:
    """The dataset keys a handler writes, in file order."""
    if handler == "pretrain":
        return json_keys
    return PAIRWISE_KEYS if handler == "pairwise" else SFT_KEYS


@dataclass
class Handler:
    """Turns records into token arrays; built once per worker process.

    Attributes:
        name: the short handler name.
        tokenizer: a `mindspeed_llm.tokenizer.Tokenizer`.
        template: the chat template (instruction and pairwise handlers).
        json_keys: the text fields of pretraining records.
        append_eod: end each pretraining document with the EOD token.
        add_bos: start each pretraining document with the BOS token.
        map_keys: column names and role tags (merged over `DEFAULT_MAP_KEYS`).
    """

    name: str
    tokenizer: Any
    template: ChatTemplate | None = None
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    add_bos: bool = False
    map_keys: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        merged = dict(DEFAULT_MAP_KEYS.get(self.name, {}))
        tags = dict(merged.get("tags", {}))
        tags.update(self.map_keys.get("tags", {}))
        merged.update({k: v for k, v in self.map_keys.items() if k != "tags"})
        if tags:
            merged["tags"] = tags
        self.map_keys = merged

    def __call__(self, record: Any) -> dict[str, list[int]]:
        """`{key: ids}` (an empty list: nothing for that key). Raises RecordError."""
        if not isinstance(record, Mapping):
            raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
        if self.name == "pretrain":
            return self._pretrain(record)
        if self.name == "pairwise":
            return self._pairwise(record)
        messages = self._alpaca(record) if self.name == "alpaca" else self._conversation(record)
        ids, labels = self._encode(messages, self._tools(record))
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    # -- pretraining ------------------------------------------------------------------

    def _pretrain(self, record: Mapping) -> dict[str, list[int]]:
        out = {}
        for key in self.json_keys:
            text = _field(record, key, str)
            if not text:
                out[key] = []
                continue
            ids = self.tokenizer.encode(text, add_bos=self.add_bos)
            if self.append_eod:
                ids.append(self._eod())
            out[key] = ids
        return out

    def _eod(self) -> int:
        if self.tokenizer.eod_id is None:
            raise DataError(f"--append-eod: tokenizer {self.tokenizer.path} has no EOS token")
        return self.tokenizer.eod_id

    # -- instruction data -------------------------------------------------------------

    def _alpaca(self, record: Mapping) -> list[dict[str, str]]:
        keys = self.map_keys
        messages = self._system(record)
        for i, turn in enumerate(_optional(record, keys.get("history"), list) or []):
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
                raise RecordError(f"history[{i}] must be a [question, answer] pair")
            if not all(isinstance(t, str) for t in turn):
                raise RecordError(f"history[{i}] must hold two strings")
            messages += [_msg("user", turn[0]), _msg("assistant", turn[1])]
        messages.append(_msg("user", self._question(record)))
        messages.append(_msg("assistant", _field(record, keys["response"], str)))
        return messages

    def _question(self, record: Mapping) -> str:
        """instruction + "\\n" + input, as MindSpeed-LLM joins them (input may be absent)."""
        prompt = _field(record, self.map_keys["prompt"], str)
        query = _optional(record, self.map_keys.get("query"), str)
        return f"{prompt}\n{query}" if query else prompt

    def _system(self, record: Mapping) -> list[dict[str, str]]:
        system = _optional(record, self.map_keys.get("system"), str)
        return [_msg("system", system)] if system else []

    def _conversation(self, record: Mapping) -> list[dict[str, str]]:
        tags = self.map_keys["tags"]
        roles = {
            tags["user_tag"]: "user",
            tags["assistant_tag"]: "assistant",
            tags["system_tag"]: "system",
            tags["observation_tag"]: "tool",
            tags["function_tag"]: "assistant",
        }
        turns = _field(record, self.map_keys["messages"], list)
        messages = self._system(record)
        for i, turn in enumerate(turns):
            where = f"{self.map_keys['messages']}[{i}]"
            if not isinstance(turn, Mapping):
                raise RecordError(f"{where} must be an object, got {type(turn).__name__}")
            role = turn.get(tags["role_tag"])
            if role not in roles:
                raise RecordError(
                    f"{where}.{tags['role_tag']} is {role!r}; expected one of {sorted(roles)}"
                )
            content = turn.get(tags["content_tag"])
            if not isinstance(content, str):
                raise RecordError(f"{where}.{tags['content_tag']} must be a string")
            messages.append(_msg(roles[role], content))
        return messages

    def _tools(self, record: Mapping) -> list | None:
        """Function schemas: a list, or a JSON string of one (LLaMA-Factory's sharegpt)."""
        key = self.map_keys.get("tools")
        tools = record.get(key) if key else None
        if isinstance(tools, str) and tools.strip():
            try:
                tools = json.loads(tools)
            except ValueError:
                raise RecordError(f"key {key!r} holds a string that is not JSON") from None
        if tools in (None, "", []):
            return None
        if not isinstance(tools, list):
            raise RecordError(f"key {key!r} must be a list of function schemas")
        return tools

    def _encode(self, messages: list[dict[str, str]], tools: list | None = None):
        """(ids, labels); `tools` (function schemas) reach the template as `tools`."""
        if not any(m["role"] == "assistant" for m in messages):
            raise RecordError("the conversation has no assistant reply to train on")
        try:
            return encode_chat(self.template, self.tokenizer, messages, tools=tools)
        except (RecordError, TemplateDefect):  # a template that cannot run stops the run
            raise
        except DataError as err:
            raise RecordError(str(err)) from None

    # -- pairwise ---------------------------------------------------------------------

    def _pairwise(self, record: Mapping) -> dict[str, list[int]]:
        keys = self.map_keys
        prompt = record.get(keys["prompt"])
        for fallback in ("instruction", "conversations", "messages"):  # alpaca, sharegpt, openai
            if prompt is None:
                prompt = record.get(fallback)
        if isinstance(prompt, str):
            query = _optional(record, keys.get("query"), str)
            prompt = self._system(record) + [
                _msg("user", f"{prompt}\n{query}" if query else prompt)
            ]
        elif isinstance(prompt, list):
            prompt = self._system(record) + [
                _as_message(m, f"prompt[{i}]") for i, m in enumerate(prompt)
            ]
        else:
            raise RecordError(
                f"missing or invalid key {keys['prompt']!r}: expected a string or a list of messages"
            )
        out = {}
        for side in ("chosen", "rejected"):
            reply = _reply(record.get(keys[side]), keys[side])
            ids, labels = self._encode(prompt + [_msg("assistant", reply)])
            out[f"{side}_input_ids"], out[f"{side}_labels"] = ids, labels
        return out


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _as_message(value: Any, where: str) -> dict[str, str]:
    if isinstance(value, Mapping):
        role = value.get("role", value.get("from"))
        content = value.get("content", value.get("value"))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        if isinstance(role, str) and isinstance(content, str):
            return _msg(role, content)
    raise RecordError(f"{where} must be a message {{role, content}}")


def _reply(value: Any, key: str) -> str:
    """A chosen/rejected answer: a string, a message, or a list ending in one."""
    if isinstance(value, list) and value:
        value = value[-1]
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return _as_message(value, key)["content"]
    raise RecordError(f"missing or invalid key {key!r}: expected a string or a message")


def _field(record: Mapping, key: str, kind: type) -> Any:
    if key not in record or record[key] is None:
        raise RecordError(f"missing key {key!r} (record has {sorted(record)})")
    value = record[key]
    if not isinstance(value, kind):
        raise RecordError(f"key {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _optional(record: Mapping, key: str | None, kind: type) -> Any:
    if not key or record.get(key) is None:
        return None
    return _field(record, key, kind)
