"""`mindspeed generate`: complete prompts with a local model, one JSON line per prompt.

    mindspeed generate --model DIR "Once upon a time" "The capital of France is"
    mindspeed generate --model DIR --input prompts.jsonl --output out.jsonl --temperature 0.7

DIR is a Hugging Face folder (config.json + safetensors + tokenizer), a converted
MindSpeed checkpoint or a run's checkpoints (see `mindspeed_llm.loading`). Defaults
come from the model's generation_config.json when present (as in transformers: greedy
unless it says do_sample); options on the command line win. Each
output line is `{"prompt", "completion", "token_ids", "finish_reason"}`, plus the other
fields of a JSONL input record. `--output` appears only once complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.files import owned_temp_prefix, read_text, remove_stale_temps

DTYPES = ("auto", "fp32", "bf16", "fp16")


def add_model_arguments(p: argparse.ArgumentParser, *, sampling: bool = True) -> None:
    """The model and device options shared by `generate`, `chat` and `serve`; with
    `sampling`, the decoding options too (a server takes them from each request)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True, help="Hugging Face folder or MindSpeed checkpoint")
    m.add_argument("--tokenizer", help="tokenizer folder or file (default: the model folder)")
    m.add_argument("--device", default="auto", help="cpu, cuda, npu or auto (default)")
    m.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: the stored dtype")
    m.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: run under torchrun --nproc-per-node N; rank 0 "
                   "reads and prints")  # fmt: skip
    m.add_argument(
        "--quantize",
        choices=("none", "int8"),
        default="none",
        help="int8: weight-only int8 linear layers, one scale per output channel (decoding "
        "reads a quarter of fp32's bytes; on CPU ~5x faster at one prompt)",
    )
    if not sampling:
        return
    s = p.add_argument_group("sampling (default: the model's generation_config.json)")
    s.add_argument("--max-new-tokens", type=int, help="new tokens per prompt at most")
    s.add_argument("--temperature", type=float, help="0: greedy; > 0: sample")
    s.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, help="sample from the top-p probability mass")
    s.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--seed", type=int, help="sampling seed (reproducible output)")
    s.add_argument("--num-beams", type=int, help="> 1: beam search with this many beams")
    s.add_argument("--length-penalty", type=float,
                   help="beam search: score = sum(log p) / length ** this (default 1.0)")  # fmt: skip
    s.add_argument("--early-stopping", choices=("true", "false", "never"),
                   help="beam search: when to stop (transformers' meanings; default false)")  # fmt: skip


def load_generator(args: argparse.Namespace):
    """The `Generator` for the parsed model options, with the folder's defaults."""
    import torch

    from mindspeed_core import device as dev
    from mindspeed_llm.generation import Generator, load_generation_config
    from mindspeed_llm.loading import load_model, resolve_model_source
    from mindspeed_llm.tokenizer import load_tokenizer

    # A folder that is no model fails here, before the tokenizer.
    source = resolve_model_source(args.model)
    option = lambda name: getattr(args, name, None)  # noqa: E731  (serve has no sampling options)
    config = load_generation_config(
        source.hf_dir,
        max_new_tokens=option("max_new_tokens"),
        temperature=option("temperature"),
        top_k=option("top_k"),
        top_p=option("top_p"),
        repetition_penalty=option("repetition_penalty"),
        stop_strings=tuple(option("stop")) if option("stop") else None,
        seed=option("seed"),
        num_beams=option("num_beams"),
        length_penalty=option("length_penalty"),
        early_stopping={"true": True, "false": False, "never": "never", None: None}[
            option("early_stopping")
        ],
    )
    tokenizer = load_tokenizer(args.tokenizer or source.tokenizer)
    device_type = dev.detect_device_type(None if args.device == "auto" else args.device)
    _check_tp(args)
    if args.tp > 1:
        from mindspeed_core.distributed import init_distributed

        device = init_distributed(device_type=device_type).device
    else:
        device = dev.get_device(0, device_type)
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    parallelize = None
    if args.tp > 1:  # split on the meta device: each rank reads only its shards
        from mindspeed_core.parallel import ParallelDims
        from mindspeed_llm.models import get_model_spec

        dims = ParallelDims(tp=args.tp).build()
        spec = get_model_spec(source.config.family)
        parallelize = lambda model: spec.parallelize(model, dims)  # noqa: E731
    model, model_config = load_model(
        source, device=device, dtype=dtype[args.dtype], parallelize=parallelize
    )
    if args.quantize == "int8":
        from mindspeed_llm.generation.quantize import quantize_weights

        quantize_weights(model)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model "
            f"{source.path} only {model_config.vocab_size}: not the model's tokenizer?"
        )
    return Generator(model, tokenizer, config)


def _check_tp(args: argparse.Namespace) -> None:
    """--tp N needs torchrun with N processes (generation has no data-parallel axis)."""
    from mindspeed_core.distributed import read_launch_env

    if args.tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {args.tp}")
    world = read_launch_env().world_size
    if args.tp != world and (args.tp > 1 or world > 1):
        raise ConfigError(
            f"--tp {args.tp} runs under torchrun --nproc-per-node {args.tp}; this is "
            f"{world} process{'es' if world > 1 else ''}"
        )
    if args.tp > 1 and args.quantize != "none":
        raise ConfigError(f"--quantize {args.quantize} runs in one process; drop --tp {args.tp}")


def is_main_rank() -> bool:
    """The process that reads input and prints (rank 0, or the only one)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mindspeed generate",
        description="Complete prompts with a local model; writes one JSON line per prompt.",
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    io = p.add_argument_group("input and output")
    io.add_argument(
        "--input",
        help="prompts file: .jsonl with a 'prompt' per line, else one prompt per line; - = stdin",
    )
    io.add_argument("--output", help="JSONL file to write (default: stdout)")
    io.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    io.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    add_model_arguments(p)
    return p


def read_prompts(prompts: list[str], input_path: str | None) -> list[dict]:
    """Records with a "prompt" string: the arguments, then the input file's lines.

    Raises:
        DataError: the file is missing or a JSONL line is not an object with a prompt.
        ConfigError: no prompt at all.
    """
    records = [{"prompt": check_utf8(p, f"prompt argument {i}")} for i, p in enumerate(prompts, 1)]
    if input_path is not None:
        records += list(_file_records(input_path))
    if not records:
        raise ConfigError("no prompts: give them as arguments or with --input FILE")
    return records


def check_utf8(text: str, where: str) -> str:
    """`text`, refused when it came from bytes that are not UTF-8 (Python keeps such bytes
    of argv and stdin as lone surrogates, which no tokenizer can encode).

    Raises:
        DataError: naming `where` and the first bad byte.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise DataError(f"{where} is not valid UTF-8 ({byte} at character {err.start})") from None
    return text


def _file_records(path: str) -> Iterator[dict]:
    if path == "-":
        raw = sys.stdin.buffer.read()
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise DataError(
                f"stdin line {line} is not valid UTF-8 (byte 0x{raw[err.start]:02x})"
            ) from None
    else:
        lines = read_text(path, "input file").splitlines()
    jsonl = path.endswith(".jsonl")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            yield {"prompt": line}
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{number}: not valid JSON: {err}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise DataError(f'{path}:{number}: expected an object with a "prompt" string')
        yield record


def _check_output(path: str | None) -> None:
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--output {path} is a folder; give a file name")
    if not target.parent.is_dir():
        raise ConfigError(f"--output folder {target.parent} does not exist")


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[TextIO]:
    """stdout, or a temporary file next to `path` renamed onto it only on success; on ranks
    other than 0 a sink."""
    if not is_main_rank():
        with open(os.devnull, "w", encoding="utf-8") as sink:
            yield sink
        return
    if path is None:
        yield sys.stdout
        return
    target = Path(path)
    remove_stale_temps(target.parent, f".{target.name}")  # what a killed run left
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=owned_temp_prefix(f".{target.name}"), suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    args = _parser().parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    records = read_prompts(args.prompts, args.input)
    _check_output(args.output)
    with closing_process_group():
        return _generate(args, records)


@contextlib.contextmanager
def closing_process_group() -> Iterator[None]:
    """Tear down the process group `load_generator` started for --tp, however we leave."""
    from mindspeed_core.distributed import destroy_distributed

    try:
        yield
    finally:
        destroy_distributed()


def _generate(args: argparse.Namespace, records: list[dict]) -> int:
    generator = load_generator(args)
    prompts = [r["prompt"] for r in records]
    if args.chat:
        from mindspeed_llm.chat_template import load_chat_template

        template = load_chat_template(generator.tokenizer.path)
        prompts = [
            generator.encode(
                template.render([{"role": "user", "content": p}], add_generation_prompt=True),
                add_bos=False,
            )
            for p in prompts
        ]
    with _output(args.output) as out:
        for start in range(0, len(records), args.batch_size):
            batch = slice(start, start + args.batch_size)
            for record, done in zip(
                records[batch], generator.complete(prompts[batch]), strict=True
            ):
                line = {
                    **record,
                    "completion": done.text,
                    "token_ids": done.token_ids,
                    "finish_reason": done.finish_reason,
                }
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
    return 0


command = Command(help="complete prompts with a local model (JSONL out)", run=main)
