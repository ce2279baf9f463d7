"""`mindspeed preprocess`: raw text or chat data -> Megatron indexed datasets.

The flags are MindSpeed-LLM's `preprocess_data.py` flags (`--input`, `--output-prefix`,
`--tokenizer-name-or-path`, `--handler-name`, `--json-keys`, `--append-eod`, `--workers`,
`--seq-length`, `--pack`, `--neat-pack`, `--map-keys`, `--max-samples`), and the output
files carry its names, so its data scripts keep working. Differences: chat data is
rendered with the tokenizer folder's Hugging Face chat template (`--chat-template` picks
another) instead of `--prompt-type`'s LLaMA-Factory templates; `--strict` stops at the
first bad record; nothing is downloaded.

Example:
    mindspeed preprocess --input data/*.jsonl --tokenizer-name-or-path ./llama3 \\
        --output-prefix out/corpus --append-eod --workers 8
    # -> out/corpus_text_document.{bin,idx}; train with --data.paths out/corpus_text_document
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError

__all__ = ["command", "main", "parse_args"]


def _parser() -> argparse.ArgumentParser:
    from mindspeed_tools.preprocess.handlers import HANDLERS

    p = ArgumentParser(
        prog="mindspeed preprocess",
        description="Tokenize json/jsonl/parquet/arrow/csv/txt data into Megatron indexed datasets.",
    )
    io = p.add_argument_group("input and output")
    io.add_argument("--input", required=True, help="a data file, a folder of them, or a glob")
    io.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    io.add_argument(
        "--tokenizer-name-or-path",
        "--tokenizer",
        "--tokenizer-model",
        dest="tokenizer",
        required=True,
        help="tokenizer folder, tokenizer.json or sentencepiece .model (local only)",
    )
    io.add_argument("--max-samples", type=int, help="read at most this many records")
    h = p.add_argument_group("handling")
    h.add_argument(
        "--handler-name",
        default="GeneralPretrainHandler",
        help=f"one of {', '.join(HANDLERS)} (default: GeneralPretrainHandler = pretrain)",
    )
    h.add_argument("--json-keys", nargs="+", default=["text"], help="pretrain text fields")
    h.add_argument("--append-eod", action="store_true", help="end each document with EOS")
    h.add_argument("--add-bos", action="store_true", help="start each document with BOS")
    h.add_argument(
        "--chat-template",
        help="a .jinja file or folder, or a template name: qwen, qwen3, llama2, llama3, chatml, "
        "mistral, deepseek3, glm4, gemma, phi3 (default: the tokenizer's)",
    )
    h.add_argument("--map-keys", help='JSON column mapping, e.g. \'{"prompt": "question"}\'')
    h.add_argument("--prompt-type", help=argparse.SUPPRESS)
    h.add_argument("--seq-length", type=int, help="drop instruction samples this long or longer")
    h.add_argument("--pack", action="store_true", help="pack samples into seq-length rows")
    h.add_argument("--neat-pack", action="store_true", help="segment ids in attention_mask")
    r = p.add_argument_group("running")
    r.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    r.add_argument("--strict", action="store_true", help="stop at the first bad record")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    # MindSpeed-LLM flags that change nothing here: the tokenizer kind is read from the
    # files, progress is a bar, and datasets' cache is a temporary folder.
    for flag in ("--tokenizer-type", "--log-interval", "--cache-dir"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--tokenizer-not-use-fast", "--overwrite-cache"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]):
    """A `PreprocessConfig` from command-line arguments."""
    from mindspeed_tools.preprocess.handlers import HANDLERS, canonical_handler
    from mindspeed_tools.preprocess.run import PreprocessConfig
    from mindspeed_tools.preprocess.worker import HandlerSpec

    args = _parser().parse_args(argv)
    handler = canonical_handler(args.handler_name)
    if handler is None:
        near = difflib.get_close_matches(args.handler_name, HANDLERS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(
            f"unknown --handler-name {args.handler_name!r}{hint} (choose from {', '.join(HANDLERS)})"
        )
    if args.prompt_type:
        raise ConfigError(
            f"--prompt-type {args.prompt_type!r}: MindSpeed renders chat data with the "
            "tokenizer's Hugging Face chat template; pass --chat-template FILE_OR_FOLDER instead"
        )
    map_keys = {}
    if args.map_keys:
        try:
            map_keys = json.loads(args.map_keys)
        except ValueError as err:
            raise ConfigError(f"--map-keys is not valid JSON: {err}") from None
        if not isinstance(map_keys, dict):
            raise ConfigError("--map-keys must be a JSON object")
    spec = HandlerSpec(
        handler,
        args.tokenizer,
        args.chat_template,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        add_bos=args.add_bos,
        map_keys=map_keys,
    )
    return PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix,
        handler=spec,
        workers=args.workers,
        seq_length=args.seq_length,
        pack=args.pack,
        neat_pack=args.neat_pack,
        strict=args.strict,
        max_samples=args.max_samples,
        progress=False if args.no_progress else None,
    )


def main(argv: list[str]) -> int:
    """Run `mindspeed preprocess` with `argv`; prints the summary line."""
    from mindspeed_tools.preprocess.run import preprocess

    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    cfg = parse_args(argv)
    _log_to_stderr()
    summary = preprocess(cfg)
    print(f"preprocess: {summary.line()}")
    for path in summary.outputs:
        print(f"  wrote {path}.bin / .idx")
    return 0


def _log_to_stderr() -> None:
    """Our warnings (skipped records, fallback template) on stderr; other libraries stay quiet."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("mindspeed")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


command = Command(help="tokenize raw data into Megatron indexed datasets", run=main)
