"""Instruction records -> chat messages: the alpaca, sharegpt and OpenAI-messages formats.

One function per record format turns a raw record (a dict read from json, jsonl or
parquet) into `[{"role", "content"}, ...]` messages; `read_records` reads a raw file with
the place of every record (`file:line`, `file: row N`) for error messages. Column names
and role tags follow MindSpeed-LLM's `--map-keys` (LLaMA-Factory's spellings), merged over
`DEFAULT_MAP_KEYS` by `merge_map_keys`. `mindspeed preprocess`, the SFT trainer and
preference data (pairwise records) share these.

| format     | record                                        |
|------------|-----------------------------------------------|
| `alpaca`   | instruction, input, output, system, history   |
| `sharegpt` | conversations [{from, value}], system, tools  |
| `messages` | messages [{role, content}], system, tools     |
| `pairwise` | prompt (or instruction/input, conversations, messages), chosen, rejected |
| `unpaired` | KTO's: prompt (as pairwise), completion (or output, response), label (or kto_tag) |
| `stepwise` | TRL's stepwise supervision: prompt, completions (or steps), labels (one bool a step) |
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mindspeed_core.errors import DataError
from mindspeed_core.files import read_text

__all__ = [
    "DEFAULT_MAP_KEYS",
    "RECORD_FORMATS",
    "RecordError",
    "detect_record_format",
    "merge_map_keys",
    "pairwise_messages",
    "read_records",
    "record_messages",
    "unpaired_messages",
    "record_tools",
]

RECORD_FORMATS = ("alpaca", "sharegpt", "messages")
"""The instruction formats `record_messages` reads."""


class RecordError(DataError):
    """One input record is unusable (missing key, wrong type, broken JSON)."""


# MindSpeed-LLM's default --map-keys per format (LLaMA-Factory's column names).
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


KIND_COMMANDS = {"alpaca": "sft", "sharegpt": "sft", "messages": "sft", "pairwise": "dpo",
                 "unpaired": "kto", "stepwise": "prm"}  # fmt: skip
"""Which command trains on each record format."""


def detect_record_format(record: Any) -> tuple[str | None, str]:
    """(format, why) of a raw record from its keys (default names, LLaMA-Factory's and TRL's):
    stepwise (prompt, completions/steps, labels), pairwise (chosen, rejected), unpaired
    (a reply and a boolean label or kto_tag), messages ([{role, content}]), sharegpt
    (conversations [{from, value}]), alpaca (instruction, output); None when no format fits."""
    if not isinstance(record, Mapping):
        return None, f"a {type(record).__name__}, not a JSON object"
    keys = set(record)
    if {"prompt", "labels"} <= keys and keys & {"completions", "steps"}:
        return "stepwise", "keys prompt, completions/steps and labels"
    if {"chosen", "rejected"} <= keys:
        return "pairwise", "keys chosen and rejected"
    if keys & {"label", "kto_tag"} and keys & set(UNPAIRED_REPLY_KEYS):
        return "unpaired", "a reply key and a label/kto_tag"
    for fmt, key, role in (("messages", "messages", "role"), ("sharegpt", "conversations", "from")):
        turns = record.get(key)
        if isinstance(turns, list) and turns and all(isinstance(t, Mapping) and role in t for t in turns):
            return fmt, f"key {key} holding {{{role}, ...}} turns"
    if {"instruction", "output"} <= keys:
        return "alpaca", "keys instruction and output"
    return None, "no known format has these keys"


def merge_map_keys(fmt: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`DEFAULT_MAP_KEYS[fmt]` with `overrides` on top (role `tags` merged key by key)."""
    overrides = overrides or {}
    merged = dict(DEFAULT_MAP_KEYS.get(fmt, {}))
    tags = dict(merged.get("tags", {}))
    tags.update(overrides.get("tags", {}))
    merged.update({k: v for k, v in overrides.items() if k != "tags"})
    if tags:
        merged["tags"] = tags
    return merged


def record_messages(record: Any, fmt: str, keys: Mapping[str, Any] | None = None) -> list[dict]:
    """The chat messages of an instruction record in format `fmt` (alpaca, sharegpt,
    messages); `keys`: merged map keys (default: the format's).

    Raises:
        RecordError: the record is not an object or lacks / mistypes a field.
    """
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"record format {fmt!r} is not one of {RECORD_FORMATS}")
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    keys = keys if keys is not None else DEFAULT_MAP_KEYS[fmt]
    return _alpaca(record, keys) if fmt == "alpaca" else _conversation(record, keys)


def _alpaca(record: Mapping, keys: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = _system(record, keys)
    for i, turn in enumerate(_optional(record, keys.get("history"), list) or []):
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise RecordError(f"history[{i}] must be a [question, answer] pair")
        if not all(isinstance(t, str) for t in turn):
            raise RecordError(f"history[{i}] must hold two strings")
        messages += [_msg("user", turn[0]), _msg("assistant", turn[1])]
    messages.append(_msg("user", _question(record, keys)))
    messages.append(_msg("assistant", _field(record, keys["response"], str)))
    return messages


def _question(record: Mapping, keys: Mapping[str, Any]) -> str:
    """instruction + "\\n" + input, as MindSpeed-LLM joins them (input may be absent)."""
    prompt = _field(record, keys["prompt"], str)
    query = _optional(record, keys.get("query"), str)
    return f"{prompt}\n{query}" if query else prompt


def _system(record: Mapping, keys: Mapping[str, Any]) -> list[dict[str, str]]:
    system = _optional(record, keys.get("system"), str)
    return [_msg("system", system)] if system else []


def _conversation(record: Mapping, keys: Mapping[str, Any]) -> list[dict[str, str]]:
    tags = keys["tags"]
    roles = {
        tags["user_tag"]: "user",
        tags["assistant_tag"]: "assistant",
        tags["system_tag"]: "system",
        tags["observation_tag"]: "tool",
        tags["function_tag"]: "assistant",
    }
    turns = _field(record, keys["messages"], list)
    messages = _system(record, keys)
    for i, turn in enumerate(turns):
        where = f"{keys['messages']}[{i}]"
        if not isinstance(turn, Mapping):
            raise RecordError(f"{where} must be an object, got {type(turn).__name__}")
        role = turn.get(tags["role_tag"])
        if role not in roles:
            raise RecordError(
                f"{where}.{tags['role_tag']} is {role!r}; expected one of {sorted(roles)}"
            )
        content = turn.get(tags["content_tag"])
        calls = turn.get("tool_calls")
        if content is None and calls is not None and roles[role] == "assistant":
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": _tool_calls(calls, f"{where}.tool_calls")})  # fmt: skip
            continue
        if not isinstance(content, str):
            raise RecordError(f"{where}.{tags['content_tag']} must be a string")
        message = _msg(roles[role], content)
        for key in ("tool_calls", "tool_call_id", "name"):  # OpenAI's tool fields, for the template
            if turn.get(key) is not None and key != tags["role_tag"] and key != tags["content_tag"]:
                message[key] = _tool_calls(turn[key], f"{where}.{key}") if key == "tool_calls" else turn[key]
        messages.append(message)
    return messages


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI's `tool_calls`: a non-empty list of {"type": "function", "function": {"name",
    "arguments"}}. Arguments come as a JSON string from OpenAI and as an object in the
    templates' eyes (transformers' convention; vLLM parses them too): a string is parsed."""
    if not isinstance(calls, list) or not calls:
        raise RecordError(f"{where} must be a non-empty list of tool calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RecordError(f'{where}[{i}] must be {{"type": "function", "function": {{"name": ..., '
                              '"arguments": ...}}')  # fmt: skip
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise RecordError(f"{where}[{i}].function.arguments is a string that is not JSON") from None
        if not isinstance(arguments, Mapping):
            raise RecordError(f"{where}[{i}].function.arguments must be a JSON object")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def record_tools(record: Mapping, keys: Mapping[str, Any]) -> list | None:
    """Function schemas: a list, or a JSON string of one (LLaMA-Factory's sharegpt)."""
    key = keys.get("tools")
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


def pairwise_messages(
    record: Any, keys: Mapping[str, Any] | None = None
) -> tuple[list[dict], list[dict]]:
    """(chosen, rejected) conversations of a preference record: the prompt's messages
    followed by the chosen or the rejected reply."""
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    keys = keys if keys is not None else DEFAULT_MAP_KEYS["pairwise"]
    prompt = record.get(keys["prompt"])
    for fallback in ("instruction", "conversations", "messages"):  # alpaca, sharegpt, openai
        if prompt is None:
            prompt = record.get(fallback)
    if isinstance(prompt, str):
        query = _optional(record, keys.get("query"), str)
        prompt = _system(record, keys) + [_msg("user", f"{prompt}\n{query}" if query else prompt)]
    elif isinstance(prompt, list):
        prompt = _system(record, keys) + [
            _as_message(m, f"prompt[{i}]") for i, m in enumerate(prompt)
        ]
    else:
        raise RecordError(
            f"missing or invalid key {keys['prompt']!r}: expected a string or a list of messages"
        )
    chosen, rejected = (
        prompt + [_msg("assistant", _reply(record.get(keys[side]), keys[side]))]
        for side in ("chosen", "rejected")
    )
    return chosen, rejected


UNPAIRED_REPLY_KEYS = ("completion", "output", "response")
"""Where an unpaired (KTO) record keeps its reply: TRL's name first, then alpaca's."""


def unpaired_messages(
    record: Any, keys: Mapping[str, Any] | None = None
) -> tuple[list[dict], bool]:
    """(conversation, desirable) of an unpaired preference record (TRL's KTO format): the
    prompt's messages (read as `pairwise_messages` reads them) then the completion, and its
    boolean `label` (LLaMA-Factory's `kto_tag` is accepted too)."""
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    reply = next(
        (k for k in UNPAIRED_REPLY_KEYS if record.get(k) is not None), UNPAIRED_REPLY_KEYS[0]
    )
    keys = {**DEFAULT_MAP_KEYS["pairwise"], **(keys or {}), "chosen": reply, "rejected": reply}
    label = record.get("label", record.get("kto_tag"))
    if not isinstance(label, bool):
        raise RecordError(f"key 'label' (or 'kto_tag') must be true or false, got {label!r}")
    return pairwise_messages(record, keys)[0], label


def stepwise_record(record: Any) -> tuple[str, list[str], list[bool]]:
    """(prompt, steps, labels) of a process-supervision record (TRL's stepwise format:
    `prompt`, `completions` or `steps`, and `labels`, one boolean per step)."""
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    prompt = _field(record, "prompt", str)
    key = "completions" if record.get("completions") is not None else "steps"
    steps, labels = _field(record, key, list), _field(record, "labels", list)
    if not steps or not all(isinstance(s, str) for s in steps):
        raise RecordError(f"key {key!r} must be a non-empty list of strings")
    if len(labels) != len(steps) or not all(isinstance(v, bool) for v in labels):
        raise RecordError(
            f"key 'labels' must hold one true/false per step ({len(steps)}), got {labels!r}"
        )
    return prompt, steps, labels


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


# -- raw files ------------------------------------------------------------------------------

RAW_SUFFIXES = (".json", ".jsonl", ".parquet")


def read_records(path: str | Path, expect: str | None = None) -> Iterator[tuple[str, Any]]:
    """(where, record) of every record of a .json (a list, or one object per line),
    .jsonl or .parquet file, in order; `where` is `file:line` or `file: row N`.
    `expect` ("pairwise", "unpaired", "stepwise"): the first record, when its keys say it is
    another kind (`detect_record_format`), stops the read naming the command that trains it.

    Raises:
        DataError: the file is missing, has another suffix, a line is not JSON, or the
            records are not of the `expect`ed kind.
    """
    records = _read_records(path)
    if expect is None:
        yield from records
        return
    for i, (where, record) in enumerate(records):
        if i == 0:
            found, why = detect_record_format(record)
            if found is not None and found != expect:
                command = KIND_COMMANDS[found]
                raise DataError(f"{where}: {found} records ({why}), not {expect} ones: train them "
                                f"with `mindspeed {command}`")  # fmt: skip
        yield where, record


def _read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file does not exist: {path}")
    suffix = path.suffix.lower()
    if suffix not in RAW_SUFFIXES:
        raise DataError(f"unsupported data file {path}: expected one of {list(RAW_SUFFIXES)}")
    if suffix == ".parquet":
        yield from _parquet(path)
        return
    text = read_text(path, "data file")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
        yield from ((f"{path}: row {i}", row) for i, row in enumerate(rows))
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}: row {i}", row
