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
| `kto` / `unpaired` (TRL's KTO format)          | prompt (as pairwise), completion, label   | input_ids, attention_mask, labels, kto_label |
| `prm` / `stepwise` (TRL's stepwise supervision) | prompt, completions (or steps), labels   | input_ids, attention_mask, labels (step labels, not shifted) |

The `prm` handler joins the steps with `--map-keys '{"step_separator": "..."}'` (default a
newline, TRL's) and puts each step's label at the last token of its separator.

Instruction and pairwise records are rendered with the tokenizer folder's chat template
(`mindspeed_llm.chat_template`); labels are -100 on every token outside the assistant
replies. Handlers run in worker processes: they hold the tokenizer and template and
raise `RecordError` for a record they cannot use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mindspeed_core.errors import DataError
from mindspeed_llm.chat_template import ChatTemplate, TemplateDefect, encode_chat
from mindspeed_llm.data.collate import IGNORE_INDEX
from mindspeed_llm.data.sft_records import (
    DEFAULT_MAP_KEYS,
    RecordError,
    merge_map_keys,
    pairwise_messages,
    record_messages,
    record_tools,
    stepwise_record,
    unpaired_messages,
)

__all__ = [
    "DEFAULT_MAP_KEYS",
    "HANDLERS",
    "Handler",
    "RecordError",
    "canonical_handler",
    "output_keys",
]

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
    "kto": "kto",
    "unpaired": "kto",
    "prm": "prm",
    "stepwise": "prm",
}
HANDLERS = tuple(sorted(_ALIASES))
SFT_KEYS = ("input_ids", "attention_mask", "labels")
PAIRWISE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
KTO_KEYS = (*SFT_KEYS, "kto_label")
"""KTO: an SFT sample plus its label, one value per record (1 desirable, 0 undesirable)."""


def canonical_handler(name: str) -> str | None:
    """The short name of a handler (`alpaca` for `AlpacaStyleInstructionHandler`), or None."""
    return _ALIASES.get(name)


def output_keys(handler: str, json_keys: tuple[str, ...]) -> tuple[str, ...]:
    """The dataset keys a handler writes, in file order."""
    if handler == "pretrain":
        return json_keys
    return {"pairwise": PAIRWISE_KEYS, "kto": KTO_KEYS}.get(handler, SFT_KEYS)


@dataclass
class Handler:
    """Turns records into token arrays; built once per worker process.

    The record formats themselves (alpaca, sharegpt, messages, pairwise -> chat
    messages) are `mindspeed_llm.data.sft_records`, shared with the SFT trainer.

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
        self.map_keys = merge_map_keys(self.name, self.map_keys)

    def __call__(self, record: Any) -> dict[str, list[int]]:
        """`{key: ids}` (an empty list: nothing for that key). Raises RecordError."""
        if not isinstance(record, Mapping):
            raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
        if self.name == "pretrain":
            return self._pretrain(record)
        if self.name == "pairwise":
            return self._pairwise(record)
        if self.name == "prm":
            from mindspeed_llm.data.sft import encode_steps  # imports torch: only when used

            ids, labels = encode_steps(self.tokenizer, *stepwise_record(record),
                                       separator=self.map_keys.get("step_separator", "\n"))  # fmt: skip
            return {
                "input_ids": ids.tolist(),
                "attention_mask": [1] * len(ids),
                "labels": labels.tolist(),
            }
        if self.name == "kto":
            messages, desirable = unpaired_messages(record, self.map_keys)
            ids, labels = self._encode(messages)
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels,
                    "kto_label": [int(desirable)]}  # fmt: skip
        messages = record_messages(record, self.name, self.map_keys)
        ids, labels = self._encode(messages, record_tools(record, self.map_keys))
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    def _pretrain(self, record: Mapping) -> dict[str, list[int]]:
        out = {}
        for key in self.json_keys:
            text = record.get(key)
            if key not in record or text is None:
                raise RecordError(f"missing key {key!r} (record has {sorted(record)})")
            if not isinstance(text, str):
                raise RecordError(f"key {key!r} must be a str, got {type(text).__name__}")
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

    def _pairwise(self, record: Mapping) -> dict[str, list[int]]:
        """Both sides of a pair; refused: the same reply twice, or a prompt whose tokens
        differ before the two replies (the trainers score the replies after one prompt)."""
        out = {}
        chosen, rejected = pairwise_messages(record, self.map_keys)
        if chosen[-1]["content"] == rejected[-1]["content"]:
            raise RecordError("chosen and rejected are the same reply; a pair must differ")
        prompts = []
        for side, messages in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = self._encode(messages)
            out[f"{side}_input_ids"], out[f"{side}_labels"] = ids, labels
            first = next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels))
            prompts.append(list(ids[:first]))
        if prompts[0] != prompts[1]:
            raise RecordError("the prompt's tokens differ before the chosen and the rejected reply "
                              "(the chat template or tokenizer merges prompt and reply)")  # fmt: skip
        return out
