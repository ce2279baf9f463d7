"""`mindspeed chat`: talk to a local model in the terminal.

    mindspeed chat --model DIR [--system "You are terse."] [--temperature 0.7]

Type a message and press Enter; the reply streams as it is generated. `clear` starts a new
conversation, `exit` (or Ctrl-D) leaves. Each prompt is the whole conversation rendered
with the model's chat template (chat_template.jinja, or tokenizer_config.json's
chat_template; ChatML when it has none); `--show-prompt` prints it to stderr first.
Replies go to stdout, everything else to stderr, so the command also reads a script of
messages from a pipe.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TextIO

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import DataError, MindSpeedError
from mindspeed_llm.chat_template import TemplateDefect
from mindspeed_tools.generate import (
    add_model_arguments,
    check_utf8,
    closing_process_group,
    is_main_rank,
    load_generator,
)

# End-of-turn pieces of common chat formats: a reply ends there even when the model's
# generation_config.json names only the end-of-text token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CLEAR, EXIT = "clear", ("exit", "quit")


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="mindspeed chat", description="Chat with a local model in the terminal."
    )
    p.add_argument("--system", help="system message at the start of every conversation")
    p.add_argument("--show-prompt", action="store_true", help="print each rendered prompt")
    add_model_arguments(p)
    return p


def chat_loop(
    generator,
    template,
    *,
    system: str | None = None,
    show_prompt: bool = False,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> None:
    """Read messages from `stdin` until `exit` or end of input; stream replies to `stdout`."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    specials = generator.tokenizer.special_tokens
    config = generator.resolved_config()
    stops = tuple(config.stop_token_ids) + tuple(specials[p] for p in END_OF_TURN if p in specials)
    config = config.replace(stop_token_ids=tuple(dict.fromkeys(stops)))
    interactive = stdin.isatty() and is_main_rank()
    if interactive:
        print(f"Type a message; '{CLEAR}' starts over, '{EXIT[0]}' leaves.", file=stderr)
    history: list[dict[str, str]] = []
    while True:
        line = _shared(_read(stdin, stderr, interactive) if is_main_rank() else None)
        if line is None or line.strip() in EXIT:
            return
        if not line.strip():
            continue
        if line.strip() == CLEAR:
            history.clear()
            print("(new conversation)", file=stderr)
            continue
        messages = [{"role": "system", "content": system}] if system else []
        messages += [*history, {"role": "user", "content": line}]
        try:
            prompt = template.render(messages, add_generation_prompt=True)
            if show_prompt:
                print(prompt, file=stderr, flush=True)
            reply = _stream(generator, generator.encode(prompt, add_bos=False), config, stdout)
        except TemplateDefect:  # the template cannot run at all: no turn will work
            raise
        except MindSpeedError as err:  # e.g. the conversation outgrew the context
            print(f"error: {' '.join(str(err).split())} ('{CLEAR}' starts over)", file=stderr)
            continue
        except KeyboardInterrupt:
            print("\n(interrupted; reply dropped)", file=stderr)
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def _read(stdin: TextIO, stderr: TextIO, interactive: bool) -> str | None:
    """One message, or None at the end of input.

    Raises:
        DataError: the line is not valid UTF-8.
    """
    try:
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and history for input())
            try:
                line = input(">>> ")
            except EOFError:
                print(file=stderr)
                return None
        else:
            line = stdin.readline()
            if not line:
                return None
            line = line.rstrip("\n")
    except UnicodeDecodeError as err:
        raise DataError(f"input is not valid UTF-8 (byte 0x{err.object[err.start]:02x})") from None
    return check_utf8(line, "input line")


def _shared(line: str | None) -> str | None:
    """Rank 0's line on every rank (--tp under torchrun: only rank 0 reads the input)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return line
    box = [line]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _stream(generator, prompt_ids, config, stdout: TextIO) -> str:
    pieces = []
    for chunk in generator.stream(prompt_ids, config):
        stdout.write(chunk)
        stdout.flush()
        pieces.append(chunk)
    stdout.write("\n")
    stdout.flush()
    return "".join(pieces)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    args = _parser().parse_args(argv)
    from mindspeed_llm.chat_template import load_chat_template

    with closing_process_group():
        generator = load_generator(args)
        template = load_chat_template(generator.tokenizer.path)
        main_rank = is_main_rank()
        if template.is_fallback and main_rank:
            print(f"note: {args.model} has no chat template; using ChatML", file=sys.stderr)
        with contextlib.ExitStack() as stack:
            sink = None if main_rank else stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115
            chat_loop(generator, template, system=args.system, show_prompt=args.show_prompt,
                      stdout=sink, stderr=sink)  # fmt: skip
    return 0


command = Command(help="chat with a local model in the terminal (streaming)", run=main)
