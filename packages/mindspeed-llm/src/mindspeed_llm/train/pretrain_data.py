"""Pretraining's data source: GPT samples of Megatron indexed datasets (or the embedded demo
corpus), packed at end-of-document tokens, as batches of the one batch contract.

Made in two steps: the constructor resolves the data and tokenizer and checks them
against the model before any process group exists; `build(dims, accum)` then opens the
datasets and the resumable sampler of this data-parallel rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelDims
from mindspeed_llm.data import build_pretrain_datasets
from mindspeed_llm.data.collate import Batch, lm_batch
from mindspeed_llm.models import TransformerConfig
from mindspeed_llm.tokenizer import load_tokenizer
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.loader import PretrainLoader

logger = logging.getLogger("mindspeed.pretrain")


class PretrainData(Stateful):
    """The step's micro-batches of this rank, the validation batches, and the position.

    `cfg.data.tokenizer` is set to the tokenizer the data was made with, so config.yaml
    records it and `mindspeed generate` on the run's checkpoints decodes with it.
    """

    def __init__(self, cfg: PretrainConfig, model_cfg: TransformerConfig):
        if cfg.train.micro_batch_tokens is not None:
            raise ConfigError(f"train.micro_batch_tokens={cfg.train.micro_batch_tokens}: pretraining's "
                              "samples are all data.seq_len tokens; use train.micro_batch")  # fmt: skip
        tokenizer_path, self.paths = _resolve_data(cfg)
        cfg.data.tokenizer = tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        _check_fits(cfg, model_cfg, self.tokenizer, tokenizer_path)
        self.cfg = cfg
        self.seq_len = cfg.data.seq_len
        self.loader: PretrainLoader | None = None

    def build(self, dims: ParallelDims, accum: int) -> None:
        """Open the datasets; `accum` micro-batches of this rank make one step."""
        cfg = self.cfg
        train, self.valid, _ = build_pretrain_datasets(
            self.paths,
            split=cfg.data.split,
            seq_len=cfg.data.seq_len,
            seed=cfg.train.seed,
            num_samples=(
                cfg.train.steps * cfg.train.global_batch,
                cfg.train.eval_batches * cfg.train.global_batch,
                0,
            ),
            cache_dir=cfg.data.cache_dir,
        )
        self.accum = accum
        self.loader = self._loader(train, dims)
        self._dims = dims

    def next_step(self) -> list[Batch]:
        return [self.loader.next_batch() for _ in range(self.accum)]

    def validation(self) -> Iterator[list[Batch]] | None:
        """`train.eval_batches` global batches, the same samples every time; None when
        there is no validation split or `train.eval_interval` is 0."""
        if self.valid is None or self.cfg.train.eval_interval <= 0:
            return None
        loader = self._loader(self.valid, self._dims)
        return ([loader.next_batch() for _ in range(self.accum)]
                for _ in range(self.cfg.train.eval_batches))  # fmt: skip

    def _loader(self, dataset, dims: ParallelDims) -> PretrainLoader:
        collate = functools.partial(
            lm_batch,
            eod_id=self.tokenizer.eod_id,
            reset_position_ids=self.cfg.data.reset_position_ids,
            reset_attention_mask=self.cfg.data.reset_attention_mask,
        )
        return PretrainLoader(
            dataset,
            micro_batch=self.cfg.train.micro_batch,
            dp_rank=dims.rank("dp"),
            dp_size=dims.dp,
            collate=collate,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


def _resolve_data(cfg: PretrainConfig) -> tuple[Path, list[str]]:
    """(tokenizer, dataset paths): the user's, or the embedded demo built on rank 0."""
    if cfg.data.paths:
        tokenizer = cfg.data.tokenizer or cfg.model.hf_path
        if tokenizer is None:
            raise ConfigError(
                "data.tokenizer (or model.hf_path) is required when data.paths is set"
            )
        return Path(tokenizer), list(cfg.data.paths)
    from mindspeed_llm.demo import cache_root, ensure_demo_data

    if is_rank0():
        ensure_demo_data()
    if dist.is_initialized():
        dist.barrier()
    demo = ensure_demo_data(cache_root())
    if cfg.model.hf_path is not None and cfg.data.tokenizer is None:
        logger.warning(
            "model.hf_path=%s without data.paths: training on the demo corpus, whose token ids "
            "come from the demo's own 512-token tokenizer, not the model's",
            cfg.model.hf_path,
        )
    return Path(cfg.data.tokenizer or demo.tokenizer), [str(demo.prefix)]


def _check_fits(cfg: PretrainConfig, model_cfg, tokenizer, tokenizer_path: Path) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {model_cfg.vocab_size}; pick a model with a larger vocabulary"
        )
    if tokenizer.eod_id is None and (cfg.data.reset_position_ids or cfg.data.reset_attention_mask):
        raise ConfigError(
            f"tokenizer {tokenizer_path} has no end-of-document token; set "
            "data.reset_position_ids=false and data.reset_attention_mask=false"
        )
    if cfg.data.seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
            f"{model_cfg.max_position_embeddings}"
        )
