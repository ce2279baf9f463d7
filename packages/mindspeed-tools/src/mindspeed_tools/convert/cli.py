"""`mindspeed convert`: Hugging Face safetensors <-> MindSpeed checkpoints, tensor by tensor.

    mindspeed convert --input HF_DIR --output OUT --to mindspeed [--tp 2 --pp 2 --ep 1]
    mindspeed convert --input CKPT --output HF_OUT --to hf [--max-shard-size 5GB]
    mindspeed convert --input LORA_RUN_CKPT --output HF_OUT --to hf --merge-lora
    mindspeed convert --input LORA_RUN_CKPT --output PEFT_OUT --to peft
    mindspeed convert --input MEGATRON_SAVE --output OUT --to hf [--tokenizer DIR]
    mindspeed convert --input MEGATRON_SAVE --output OUT --to mindspeed --with-optimizer
    mindspeed convert --input HF_DIR --output MEGATRON_SAVE --to megatron --tp 2 --pp 2

This module reads the flags, refuses combinations we do not convert (one line, exit 2) and
picks the route: `hf` (Hugging Face <-> MindSpeed), `peft` (LoRA runs), `megatron` (both
Megatron formats, both ways).
"""

from __future__ import annotations

import argparse
import re

import torch

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.distributed import setup_logging
from mindspeed_core.errors import ConfigError
from mindspeed_llm.hf_export import merge_lora_to_hf, mindspeed_to_hf
from mindspeed_tools.convert.hf import hf_to_mindspeed
from mindspeed_tools.convert.megatron.files import LATEST_FILE, is_megatron_checkpoint
from mindspeed_tools.convert.megatron.routes import (
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_mindspeed,
)
from mindspeed_tools.convert.peft import lora_to_peft

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_size(text: str) -> int:
    """Bytes in "5GB", "500MB", "2GiB" or a plain number of bytes.

    Raises:
        ConfigError: not a size.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"--max-shard-size={text!r} is not a size like 5GB or 500MB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]
    if value < 1:
        raise ConfigError(f"--max-shard-size={text!r} must be positive")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mindspeed convert",
        description="Convert Hugging Face safetensors <-> MindSpeed (DCP) checkpoints, "
        "tensor by tensor. One MindSpeed checkpoint loads under any tp/pp/ep layout.",
    )
    p.add_argument(
        "--input", required=True, help="HF folder, MindSpeed checkpoint, or Megatron save folder"
    )
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("hf", "mindspeed", "megatron"),
        help="source format (default: a Megatron save folder is recognised by its "
        f"{LATEST_FILE}; otherwise hf for --to mindspeed, mindspeed for --to hf)",
    )
    p.add_argument(
        "--tokenizer", help="--from megatron: tokenizer folder or file to copy into the output"
    )
    p.add_argument("--output", required=True, help="folder to create (must not exist)")
    p.add_argument(
        "--to", required=True, choices=("mindspeed", "hf", "peft", "megatron"), help="target format"
    )
    p.add_argument("--merge-lora", action="store_true", help="--to hf: merge a LoRA run's adapters")
    p.add_argument("--tp", type=int, default=1, help="tp degree to check (--to megatron: to write)")
    p.add_argument("--pp", type=int, default=1, help="pp degree to check (--to megatron: to write)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree to validate")
    p.add_argument(
        "--with-optimizer",
        action="store_true",
        help="--from megatron --to mindspeed: carry Adam's moments and step (torch_dist saves)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="keep", help="stored dtype")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: largest safetensors file")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    dtype = DTYPES[args.dtype]
    if args.merge_lora and args.to != "hf":
        raise ConfigError("--merge-lora applies to --to hf only")
    source_format = args.source_format
    if source_format is None and is_megatron_checkpoint(args.input):
        source_format = "megatron"
    if args.tokenizer is not None and source_format != "megatron":
        raise ConfigError("--tokenizer applies to --from megatron only")
    if args.with_optimizer and (source_format != "megatron" or args.to != "mindspeed"):
        raise ConfigError("--with-optimizer applies to --from megatron --to mindspeed only")
    if source_format == "megatron":
        if args.to == "peft" or args.merge_lora:
            raise ConfigError("--from megatron converts to --to hf or --to mindspeed")
        if not is_megatron_checkpoint(args.input):
            raise ConfigError(f"--from megatron: {args.input} has no {LATEST_FILE}")
        if args.to == "mindspeed":
            megatron_to_mindspeed(
                args.input,
                args.output,
                tokenizer=args.tokenizer,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                dtype=dtype,
                with_optimizer=args.with_optimizer,
            )
        else:
            if (args.tp, args.pp, args.ep) != (1, 1, 1):
                raise ConfigError("--tp/--pp/--ep apply to --to mindspeed only")
            size = parse_size(args.max_shard_size)
            megatron_to_hf(
                args.input, args.output, tokenizer=args.tokenizer, max_shard_size=size, dtype=dtype
            )
        return 0
    expected = {"mindspeed": "hf", "hf": "mindspeed", "peft": "mindspeed", "megatron": "hf"}
    expected = expected[args.to]
    if source_format not in (None, expected):
        raise ConfigError(f"--from {source_format} --to {args.to} is not a conversion we make")
    if args.to == "megatron":
        if args.merge_lora or args.ep != 1:
            raise ConfigError("--to megatron takes --tp and --pp only (dense models)")
        hf_to_megatron(args.input, args.output, tp=args.tp, pp=args.pp, dtype=dtype)
    elif args.to == "peft":
        lora_to_peft(args.input, args.output)
    elif args.to == "mindspeed":
        hf_to_mindspeed(args.input, args.output, tp=args.tp, pp=args.pp, ep=args.ep, dtype=dtype)
    else:
        if (args.tp, args.pp, args.ep) != (1, 1, 1):
            raise ConfigError("--tp/--pp/--ep apply to --to mindspeed only")
        size = parse_size(args.max_shard_size)
        to_hf = merge_lora_to_hf if args.merge_lora else mindspeed_to_hf
        to_hf(args.input, args.output, max_shard_size=size, dtype=dtype)
    return 0


command = Command(help="convert Hugging Face <-> MindSpeed checkpoints (any layout)", run=main)
