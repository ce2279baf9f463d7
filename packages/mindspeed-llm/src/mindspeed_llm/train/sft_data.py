"""SFT's data source: instruction samples of this data-parallel rank, padded or packed.

Made in two steps, as pretraining's: the constructor resolves the tokenizer and chat
template, reads (or tokenises and caches) every file, fits samples to `seq_len`, holds
out the validation split and lays out the rows, before any process group exists;
`build(dims, accum)` then places this rank in the sampler.

The sampler walks the training rows epoch after epoch, each epoch in its own seeded
order; the global batch of a step is the next `global_batch` rows and each rank takes
its slice, so the position is one number (rows consumed) and a resumed run, even in
another layout, sees the rows an uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.parallel import ParallelDims
from mindspeed_llm.data.collate import Batch
from mindspeed_llm.data.sft import (
    Sample,
    SFTStats,
    collate_rows,
    fit_samples,
    pack_rows,
    read_prefix,
    tokenize_file,
)
from mindspeed_llm.data.sft_records import RAW_SUFFIXES
from mindspeed_llm.data.token_budget import plan_micro_batches, rank_tokens
from mindspeed_llm.models import TransformerConfig
from mindspeed_llm.tokenizer import load_tokenizer

__all__ = ["SFTData", "load_samples"]

logger = logging.getLogger("mindspeed.sft")


class SFTData(Stateful):
    """The step's micro-batches of this rank, the validation batches, and the position."""

    def __init__(self, cfg, model_cfg: TransformerConfig):
        from mindspeed_llm.data.sft_templates import resolve_template

        data = cfg.data
        if not data.paths:
            self.use_demo(cfg)
        tokenizer_path = data.tokenizer or cfg.model.hf_path
        if tokenizer_path is None:
            raise ConfigError("data.tokenizer (or model.hf_path) is required with data.paths")
        data.tokenizer = Path(tokenizer_path)
        self.tokenizer = load_tokenizer(data.tokenizer)
        _check_fits(data, model_cfg, self.tokenizer)
        self.template = resolve_template(data.chat_template, data.tokenizer)
        self.cfg, self.seq_len = cfg, data.seq_len
        samples, stats = self.load(data)
        self.stats = stats
        self.train, self.valid = _split(samples, data.valid_fraction, cfg.train.seed)
        self.rows = self.rows_of(self.train)
        if data.epochs is not None:
            cfg.train.steps = max(
                1, math.ceil(data.epochs * len(self.rows) / cfg.train.global_batch)
            )
            if cfg.optim.warmup_steps > cfg.train.steps:
                raise ConfigError(
                    f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds the "
                    f"{cfg.train.steps} steps of data.epochs={data.epochs}"
                )
        if is_rank0():
            logger.info("sft data: %s; %d rows (%s), %d validation samples", stats.line(),
                        len(self.rows), data.mode, len(self.valid))  # fmt: skip
        self.pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        self.consumed = 0
        self.budget = cfg.train.micro_batch_tokens
        self._check_budget()
        self._order = (-1, None)
        self.step_metrics: dict[str, float] = {}
        """Tokens per data-parallel rank of the last step (logged with the step)."""

    def use_demo(self, cfg) -> None:
        """Point `cfg.data` at the embedded demo (a subclass points it at its own)."""
        from mindspeed_llm.sft_demo import use_demo_data

        use_demo_data(cfg)

    def load(self, data) -> tuple[list, SFTStats]:
        """Every training unit of `data.paths` and the counts (a subclass may read pairs)."""
        return load_samples(data, self.template, self.tokenizer)

    def set_samples(self, train: list, valid: list) -> None:
        """Replace the training and validation units (same number, in the same order: e.g.
        each with its precomputed reference log-probs); the rows follow."""
        if (len(train), len(valid)) != (len(self.train), len(self.valid)):
            raise ValueError("set_samples keeps the number of training and validation units")
        self.train, self.valid = train, valid
        self.rows = self.rows_of(train)
        self._order = (-1, None)
        self._check_budget()

    def _check_budget(self) -> None:
        """`train.micro_batch_tokens` must hold the longest unit whole."""
        if self.budget is None:
            return
        longest = max(self.unit_tokens(u) for u in self.rows + self.rows_of(self.valid))
        if longest > self.budget:
            raise ConfigError(f"train.micro_batch_tokens={self.budget} is below the longest "
                              f"sample ({longest} tokens); raise it to at least {longest}")  # fmt: skip

    # How a subclass shapes its units (preference pairs, KTO examples): `rows_of` groups
    # them into the rows a micro-batch takes, `collate` turns a step's rows into batches.

    def rows_of(self, samples: list[Sample]) -> list[list[Sample]]:
        """The training rows of `samples`: one each (`data.mode=pad`) or packed."""
        if self.cfg.data.mode == "pad":
            return [[s] for s in samples]
        return [[samples[i] for i in row] for row in pack_rows([len(s[0]) for s in samples], self.seq_len)]  # fmt: skip

    def build(self, dims: ParallelDims, accum: int) -> None:
        """Place this rank: `accum` micro-batches of `train.micro_batch` rows per step."""
        self.accum, self.dp_rank, self.dp = accum, dims.rank("dp"), dims.dp
        # a padded width every layout splits evenly (sequence parallel, cp's 2 x cp chunks)
        self.multiple = math.lcm(2 * dims.cp, dims.tp)

    def next_step(self) -> list[Batch]:
        if self.budget is not None:
            units = [self._row(self.consumed + i) for i in range(self.cfg.train.global_batch)]
            self.consumed += len(units)
            return self._budget_step(units)
        micro = self.cfg.train.micro_batch
        groups, loads = [], [0] * self.dp
        for _ in range(self.accum):
            for rank in range(self.dp):  # every rank's rows, for the tokens-per-rank metrics
                rows = [self._row(self.consumed + rank * micro + j) for j in range(micro)]
                loads[rank] += sum(self.unit_tokens(row) for row in rows)
                if rank == self.dp_rank:
                    groups.append(rows)
            self.consumed += micro * self.dp
        self.step_metrics = _balance_metrics(loads)
        return self.collate(groups)

    def _budget_step(self, units: list) -> list[Batch]:
        """This rank's micro-batches of the step's `units` under `train.micro_batch_tokens`."""
        lengths = [self.unit_tokens(u) for u in units]
        plans = plan_micro_batches(lengths, self.dp, self.budget)
        self.step_metrics = _balance_metrics(rank_tokens(lengths, plans))
        return self.collate_budget([[units[i] for i in mb] for mb in plans[self.dp_rank]])

    def _row(self, index: int) -> list[Sample]:
        epoch, position = divmod(index, len(self.rows))
        if self._order[0] != epoch:  # one permutation per epoch, not per row
            rng = np.random.default_rng([self.cfg.train.seed, epoch])
            self._order = (epoch, rng.permutation(len(self.rows)))
        return self.rows[self._order[1][position]]

    def unit_tokens(self, unit) -> int:
        """The tokens of a training unit (a row of samples, a pair: its sequences)."""
        return sum(len(s[0]) for s in unit)

    def collate_budget(self, groups: list[list]) -> list[Batch]:
        """`train.micro_batch_tokens`: each group of units one packed row, as wide as its
        tokens rounded up to the layout's multiple (an empty group: one row of padding)."""
        batches = []
        for group in groups:
            samples = [s for row in group for s in row]
            width = self.budget_width(sum(len(s[0]) for s in samples))
            batches.append(collate_rows([samples], width, self.pad_id))
        return batches

    def budget_width(self, tokens: int) -> int:
        return max(1, -(-tokens // self.multiple)) * self.multiple

    def collate(self, groups: list[list[list[Sample]]]) -> list[Batch]:
        """One batch per group of rows. Packed rows are `seq_len` wide; padded ones as wide as the step's longest."""
        if self.cfg.data.mode == "pack":
            width = self.seq_len
        else:
            longest = max(sum(len(s[0]) for s in row) for g in groups for row in g)
            width = min(self.seq_len, -(-longest // self.multiple) * self.multiple)
            width = max(width, longest)
        return [collate_rows(g, width, self.pad_id) for g in groups]

    def validation(self) -> Iterator[list[Batch]] | None:
        """The held-out samples, every one once, a step's micro-batches at a time; rows
        past the end repeat from the start so every rank takes as many steps."""
        if not self.valid or self.cfg.train.eval_interval <= 0:
            return None
        rows = self.rows_of(self.valid)
        if self.budget is not None:
            return self._budget_validation(rows)
        micro = self.cfg.train.micro_batch
        per_step = micro * self.dp * self.accum
        steps = min(self.cfg.train.eval_batches, math.ceil(len(rows) / per_step))

        def batches():
            for s in range(steps):
                groups = []
                for a in range(self.accum):
                    start = s * per_step + (a * self.dp + self.dp_rank) * micro
                    groups.append([rows[(start + j) % len(rows)] for j in range(micro)])
                yield self.collate(groups)

        return batches()

    def _budget_validation(self, rows: list) -> Iterator[list[Batch]]:
        """The validation steps under `train.micro_batch_tokens`: `global_batch` units each,
        planned as training steps are (metrics of training left alone)."""
        per_step = self.cfg.train.global_batch
        steps = min(self.cfg.train.eval_batches, math.ceil(len(rows) / per_step))
        metrics = self.step_metrics
        for s in range(steps):
            yield self._budget_step([rows[(s * per_step + i) % len(rows)] for i in range(per_step)])
        self.step_metrics = metrics

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_rows": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = int(state_dict["consumed_rows"])


def load_samples(data, template, tokenizer) -> tuple[list[Sample], SFTStats]:
    """Every sample of `data.paths` (raw files or preprocess prefixes), fitted to
    `data.seq_len`; raw files are tokenised on rank 0 first (the others read its cache)."""
    from mindspeed_llm.demo import cache_root

    cache_dir = data.cache_dir or cache_root() / "sft"
    stats, samples = SFTStats(), []
    for path in data.paths:
        if Path(path).suffix.lower() in RAW_SUFFIXES:
            on_rank0(lambda: tokenize_file(path, data.handler, template, tokenizer,  # noqa: B023
                                           strict=data.strict, cache_dir=cache_dir))  # fmt: skip
            found, found_stats = tokenize_file(path, data.handler, template, tokenizer,
                                               strict=data.strict, cache_dir=cache_dir)  # fmt: skip
        else:
            found, found_stats = read_prefix(path)
        samples += found
        stats.add(found_stats)
    samples = fit_samples(samples, data.seq_len, data.overflow, stats)
    if not samples:
        raise DataError(
            f"data.paths {data.paths}: no sample to train on ({stats.line()}; "
            f"data.handler={data.handler})"
        )
    return samples, stats


def on_rank0(fn) -> None:
    """Run `fn` on rank 0 while the others wait; its DataError/ConfigError is raised on
    every rank (so no rank waits forever for one that failed)."""
    error = None
    if is_rank0():
        try:
            fn()
        except (DataError, ConfigError) as err:
            error = (type(err).__name__, str(err))
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise (DataError if error[0] == "DataError" else ConfigError)(error[1])


def _balance_metrics(loads: list[int]) -> dict[str, float]:
    return {"rank_tokens_max": float(max(loads)), "rank_tokens_min": float(min(loads))}


def _split(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, valid): a seeded `fraction` of the samples held out (at least one)."""
    n_valid = 0 if fraction == 0 or len(samples) < 2 else max(1, round(fraction * len(samples)))
    order = np.random.default_rng(seed).permutation(len(samples))
    return [samples[i] for i in sorted(order[n_valid:])], [samples[i] for i in sorted(order[:n_valid])]  # fmt: skip


def _check_fits(data, model_cfg: TransformerConfig, tokenizer) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {data.tokenizer} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {model_cfg.vocab_size}; pick a model with a larger vocabulary"
        )
    if data.seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds the model's max_position_embeddings="
            f"{model_cfg.max_position_embeddings}"
        )
