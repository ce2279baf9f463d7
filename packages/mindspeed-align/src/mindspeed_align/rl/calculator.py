"""The calculator environment and its embedded demo (`mindspeed grpo --env calculator`).

Task: "what is 37 times 48?" with two-digit factors; the episode's reward is 1 when the
last number of the final reply is the exact product. The policy may call the tool
`calculator` ({"expression": "37 * 48"}: integers, + - * and parentheses) in the
Qwen/Hermes `<tool_call>` format; its result comes back as a tool turn.

The demo's starting model is a debug Llama fine-tuned briefly (SFT) on demonstrations in
which a quarter of the questions are answered through the tool and the rest are answered
directly (the product written out, which a tiny model cannot compute). It thus knows both
ways but, greedy, answers directly and is mostly wrong; sampling, it sometimes calls the
tool, is right, and GRPO makes that its habit. A tokenizer and a chat template for the
demo (`question: ... answer: ...</s> result: ... answer: ...</s>`) are built with the
demonstrations and cached next to the other demos.
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_align.rl.env import parse_tool_calls

__all__ = ["CalculatorEnv", "CalculatorDemo", "calculate", "demonstrations", "ensure_calculator_demo",
           "records"]  # fmt: skip

DEMO_VERSION = "v1"
TOOL_FRACTION = 0.25
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'question: ' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ ' answer: ' + m['content'] + '</s>' }}"
    "{% elif m['role'] == 'tool' %}{{ ' result: ' + m['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' answer: ' }}{% endif %}"
)
"""The demo's chat format: `question: Q answer: REPLY</s> result: R answer: REPLY</s>`."""

_NUMBER = re.compile(r"-?\d+")
_MAX_EXPRESSION = 64


def calculate(expression: str) -> str:
    """The value of an integer expression with + - * and parentheses, as text; or a line
    starting with "error:" saying what is wrong with it."""
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION:
        return f"error: the expression must be a string of at most {_MAX_EXPRESSION} characters"
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return f"error: cannot read the expression {expression!r}"

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return {ast.Add: left + right, ast.Sub: left - right,
                    ast.Mult: left * right}[type(node.op)]  # fmt: skip
        raise ValueError

    try:
        return str(value(tree.body))
    except ValueError:
        return f"error: only integers, + - * and parentheses are allowed in {expression!r}"


class CalculatorEnv:
    """One episode of the calculator task (see the module's docstring). A record is
    {"question": str, "answer": int}."""

    tool_name = "calculator"
    tools = [{"type": "function", "function": {
        "name": "calculator",
        "description": "The value of an integer expression with + - * and parentheses.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "e.g. 37 * 48"}}},
    }}]  # fmt: skip
    """The tool's schema, as chat templates take it (the demo's own template ignores it)."""

    def __init__(self):
        self.answer: int | None = None

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        self.answer = int(record["answer"])
        return [{"role": "user", "content": str(record["question"])}]

    def step(self, messages, reply: str):
        calls = parse_tool_calls(reply)
        if calls:
            return [{"role": "tool", "content": self._run(call)} for call in calls], 0.0, False
        numbers = _NUMBER.findall(reply)
        return [], float(bool(numbers) and int(numbers[-1]) == self.answer), True

    def _run(self, call) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        if call.name != self.tool_name:
            return f"error: there is no tool {call.name!r}; the tool is {self.tool_name!r}"
        return calculate(call.arguments.get("expression"))


def records(count: int, seed: int) -> list[dict[str, Any]]:
    """Questions with two-digit factors and their products."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"question": f"what is {a} times {b}?", "answer": a * b, "a": a, "b": b})
    return out


def tool_call_text(expression: str) -> str:
    arguments = {"name": CalculatorEnv.tool_name, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(arguments)}</tool_call>"


def demonstrations(count: int, seed: int, tool_fraction: float = TOOL_FRACTION) -> list[dict]:
    """SFT conversations: `tool_fraction` of them call the tool and copy its result, the
    rest write the product directly."""
    rng = random.Random(seed)
    out = []
    for record in records(count, seed):
        user = {"role": "user", "content": record["question"]}
        final = {"role": "assistant", "content": f"the answer is {record['answer']}"}
        if rng.random() < tool_fraction:
            call = tool_call_text(f"{record['a']} * {record['b']}")
            out.append({"messages": [user, {"role": "assistant", "content": call},
                                     {"role": "tool", "content": str(record["answer"])}, final]})  # fmt: skip
        else:
            out.append({"messages": [user, final]})
    return out


@dataclass(frozen=True)
class CalculatorDemo:
    tokenizer: Path
    template: Path
    train: Path
    """SFT demonstrations (JSONL of {"messages": [...]})."""


def ensure_calculator_demo(root: Path | None = None) -> CalculatorDemo:
    """The demo's tokenizer, template and demonstrations, built on first use (call on one
    rank)."""
    from mindspeed_core.files import staged_folder
    from mindspeed_llm.chat_template import ChatTemplate
    from mindspeed_llm.demo import cache_root
    from mindspeed_llm.tokenizer import train_sentencepiece

    folder = (root or cache_root()) / f"calculator-demo-{DEMO_VERSION}"
    demo = CalculatorDemo(folder / "tokenizer.model", folder / "template.jinja",
                          folder / "train.jsonl")  # fmt: skip
    if demo.train.is_file():
        return demo
    with staged_folder(folder) as staging:  # all or nothing
        rows = demonstrations(6000, seed=1)
        template = ChatTemplate(TEMPLATE, {"eos_token": "</s>"})
        texts = [template.render(r["messages"]).replace("</s>", " ") for r in rows]
        train_sentencepiece(texts, staging / "tokenizer", 440)
        (staging / "template.jinja").write_text(TEMPLATE)
        (staging / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return demo
