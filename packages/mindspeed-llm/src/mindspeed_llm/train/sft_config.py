"""The SFT configuration: pretraining's sections, with an SFT data section.

`model`, `parallel`, `optim`, `train`, `checkpoint`, `logging` and `profile` are the very
classes `PretrainConfig` uses (same fields, same spellings); only `data` differs:
instruction samples from raw files or preprocess outputs, a chat template, pad or pack.
Defaults are the embedded demo (`mindspeed sft` with no arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mindspeed_core.checkpoint import CheckpointConfig
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.profiling import ProfileConfig
from mindspeed_llm.peft.lora import LoRAConfig
from mindspeed_llm.train.config import LoggingSection, ModelSection, TrainSection

__all__ = ["SFTConfig", "SFTDataSection"]


@dataclass(kw_only=True)
class SFTDataSection:
    paths: list[str] = field(default_factory=list)
    """Raw .json/.jsonl/.parquet files (tokenised on first use and cached), or
    `mindspeed preprocess` output prefixes (MindSpeed-LLM's names: a prefix P with
    `P_packed_input_ids_document.{bin,idx}` and `P_packed_labels_document.{bin,idx}`).
    Empty: the embedded demo task (generated and cached on first use)."""
    handler: Literal["auto", "alpaca", "sharegpt", "messages"] = "auto"
    """The record format of raw files; auto: each file's, told from its first record's keys
    (said in the log; a file mixing formats is refused at the first record of another kind).
    MindSpeed-LLM's handler names work in preprocess."""
    tokenizer: Path | None = None
    """A tokenizer.json, sentencepiece .model or a folder holding one (default:
    model.hf_path; the demo: its own)."""
    chat_template: str | None = None
    """A template name (qwen, qwen3, llama2, llama3, chatml, mistral, deepseek3, glm4,
    gemma, phi3), a .jinja file, or None: the tokenizer folder's own template."""
    seq_len: int = 128
    """Tokens per row: the longest sample, and the width of a packed row."""
    mode: Literal["pad", "pack"] = "pack"
    """pad: one sample per row, padded to the longest of the step; pack: several samples
    per row of `seq_len` tokens, kept apart by `cu_seqlens` (no sample attends to
    another's tokens)."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """Samples longer than `seq_len`: cut to `seq_len` tokens, or left out (counted)."""
    strict: bool = False
    """A record that cannot be used (no assistant reply, a bad field) stops the run
    instead of being skipped and counted."""
    epochs: float | None = None
    """Train this many passes over the training samples (sets train.steps); None: use
    train.steps."""
    valid_fraction: float = 0.05
    """Samples held out for validation (0: none)."""
    cache_dir: Path | None = None
    """Where tokenised raw files are cached (default: $MINDSPEED_CACHE/sft)."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be at least 2")
        if not 0 <= self.valid_fraction < 1:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction} must be in [0, 1)")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"data.epochs={self.epochs} must be positive")


def _sft_train() -> TrainSection:
    return TrainSection(steps=400, micro_batch=8, global_batch=16, eval_interval=100)


@dataclass(kw_only=True)
class SFTConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: SFTDataSection = field(default_factory=SFTDataSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=_sft_train)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir=Path("runs/sft")))
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapters (LoRA/QLoRA, `mindspeed_llm.peft`), plugged in through the trainer's
    `after_tp` hook; `lora.rank 0` (the default): full fine-tuning."""

    def __post_init__(self):
        if self.optim.warmup_steps > self.train.steps and self.data.epochs is None:
            raise ConfigError(
                f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
            )
