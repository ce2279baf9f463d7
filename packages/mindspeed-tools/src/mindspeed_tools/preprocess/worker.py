"""The per-process side of preprocessing: parse and tokenize chunks of records.

Worker processes build one `Handler` in `init_worker` and answer `process_chunk` calls
(importing this module pulls in torch through mindspeed_llm.data, which is why the pool arms
`mindspeed_core.lifeline` before it imports us). With
`--workers 1` the same two functions run in the main process, so the output does not
depend on the number of workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mindspeed_tools.preprocess.handlers import Handler, RecordError
from mindspeed_tools.preprocess.sources import BadText, Item

__all__ = ["HandlerSpec", "Result", "init_worker", "process_chunk", "process_item"]

Result = tuple[str, str, Any]
"""(status, where, payload): ("ok", where, {key: int32 array}), ("empty", where, None),
or ("bad", where, reason)."""

_HANDLER: Handler | None = None


@dataclass(frozen=True)
class HandlerSpec:
    """What a worker needs to build its handler (plain data, cheap to send)."""

    name: str
    tokenizer: str
    chat_template: str | None = None
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    add_bos: bool = False
    map_keys: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Handler:
        from mindspeed_llm.data.sft_templates import resolve_template
        from mindspeed_llm.tokenizer import load_tokenizer

        template = None
        if self.name != "pretrain":  # a .jinja file or folder, a template name, or the tokenizer's
            template = resolve_template(self.chat_template, self.tokenizer, field="--chat-template")
        return Handler(
            self.name,
            load_tokenizer(self.tokenizer),
            template,
            json_keys=self.json_keys,
            append_eod=self.append_eod,
            add_bos=self.add_bos,
            map_keys=dict(self.map_keys),
        )


def init_worker(spec: dict[str, Any]) -> None:
    """Build this process's handler from a `HandlerSpec`'s fields (plain data: a child
    unpickles its pool's arguments before the initializer runs, and unpickling a HandlerSpec
    would import this module before `mindspeed_core.lifeline` tied the child to its parent)."""
    global _HANDLER
    _HANDLER = HandlerSpec(**spec).build()


def process_chunk(items: list[Item]) -> list[Result]:
    """Results of `items`, in order; an unusable record gives a "bad" result, not an error."""
    assert _HANDLER is not None, "init_worker was not called"
    return [process_item(_HANDLER, item) for item in items]


def process_item(handler: Handler, item: Item) -> Result:
    """The result of one item (what `process_chunk` does for each)."""
    where, raw, record = item
    if raw is not None:
        if isinstance(raw, BadText):
            return "bad", where, str(raw)
        if not raw.strip():
            return "empty", where, None
        try:
            record = json.loads(raw)
        except ValueError as err:
            detail = (
                f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else err
            )
            return "bad", where, f"broken JSON: {detail}"
    try:
        arrays = handler(record)
    except RecordError as err:
        return "bad", where, str(err)
    if not any(arrays.values()):
        return "empty", where, None
    return "ok", where, {key: np.asarray(ids, dtype=np.int32) for key, ids in arrays.items()}
