"""The training loop of every trainer: steps -> metrics, validation, checkpoints, resume.

    resume (checkpoint.load) -> config.yaml, metrics.jsonl (run directory)
    until train.steps (or train.exit_at_step):
        step on the data source's next micro-batches
        validation every train.eval_interval steps and at the last step
        metrics.jsonl / TensorBoard / progress bar every logging.log_interval steps
        checkpoint every checkpoint.interval steps
    a last checkpoint, the loss curve

A `DataSource` gives this rank's micro-batches of each step, the validation batches,
and its position (checkpointed as "data", so a resumed run sees the same samples).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from tqdm import tqdm

from mindspeed_core import device as dev
from mindspeed_core.checkpoint import CheckpointManager
from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.profiling import ProfileConfig, build_profiler
from mindspeed_core.training import MetricsWriter, ThroughputMeter
from mindspeed_llm.data.collate import Batch
from mindspeed_llm.hf_export import merge_lora_to_hf, mindspeed_to_hf
from mindspeed_llm.train.build import DTYPES
from mindspeed_llm.train.config import LoggingSection, TrainSection
from mindspeed_llm.train.run_dir import RunDirectory, resume
from mindspeed_llm.train.step import TrainingError, TrainStep

logger = logging.getLogger("mindspeed.train")

__all__ = ["DataSource", "TrainLoop"]


class DataSource(Protocol):
    """What the loop reads: the protocol pretraining's `PretrainData` follows. A source may
    also hold `step_metrics`, a dict of host numbers about the last step's data (SFT's
    `rank_tokens_max` / `rank_tokens_min`), logged with that step."""

    seq_len: int
    """Tokens per row (FLOPs, context-parallel checks)."""

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""

    def validation(self) -> Iterable[list[Batch]] | None:
        """The validation set, a step's micro-batches at a time (the same every call);
        None: no validation."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TrainLoop:
    """Runs `step` on `data` for `train.steps` steps.

    Args:
        step: the optimizer step (model, objective, optimizer inside).
        data: this rank's batches.
        checkpoints: saves and resumes the states of the run.
        run_dir: the run directory.
        cfg: the whole config, written to config.yaml.
        train / logging: the sections the loop reads (steps, cadences, load).
        load: `checkpoint.load`.
        command: names the progress bar.
        profile: the `profile` section (torch.profiler traces of a window of steps).
        startup_peak_gb: every rank's memory peak once its models were built (logged when
            the run starts, after its checkpoint is resumed).
    """

    def __init__(
        self,
        step: TrainStep,
        data: DataSource,
        *,
        checkpoints: CheckpointManager,
        run_dir: RunDirectory,
        cfg: Any,
        train: TrainSection,
        logging: LoggingSection,
        load: Any = "auto",
        command: str = "train",
        profile: ProfileConfig | None = None,
        startup_peak_gb: list[float] | None = None,
    ):
        self.step, self.data, self.checkpoints, self.run_dir = step, data, checkpoints, run_dir
        self.cfg, self.train, self.logging, self.load = cfg, train, logging, load
        self.command, self.profile = command, profile
        self.startup_peak_gb = startup_peak_gb
        self.state = step.state

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the first and last loss of this run and the step."""
        locks = self.run_dir.lock(self.checkpoints.folder)  # one run per folder
        summary = None
        try:
            summary = self._run()
        finally:
            self.run_dir.unlock(locks, discard=summary is None and self.state.step == 0)
        return summary

    def _run(self) -> dict[str, float]:
        resumed = resume(self.checkpoints, self.load, self.checkpoints.states)
        if self.startup_peak_gb is not None:
            logger.info("start-up peak per rank %s GiB (models built, weights loaded)",
                        ", ".join(f"{peak:.2f}" for peak in self.startup_peak_gb))  # fmt: skip
        metrics = self.run_dir.start(self.cfg, resumed)
        profiler = build_profiler(
            self.profile,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            device=self.step.model.device,
            run_dir=self.run_dir.path,
            start_step=self.state.step,
        )
        try:
            summary = self._loop(metrics, profiler)
        finally:
            profiler.close()
            metrics.close()
        self._finish()
        summary["peak_gb_per_rank"] = peak_per_rank(self.step.model.device)
        return summary

    def _loop(self, metrics: MetricsWriter, profiler) -> dict[str, float]:
        model = self.step.model
        peak = dev.peak_flops(model.device, DTYPES[self.train.precision])
        meter = ThroughputMeter(model.flops_per_token, peak)
        bar = tqdm(
            total=self.train.steps,
            initial=self.state.step,
            disable=not (metrics.enabled and self.logging.progress),
            desc=self.command,
            dynamic_ncols=True,
        )
        first = last = None
        unread: list = []  # results not read yet: their tokens are not counted yet
        tokens_since_log = 0
        busy = False  # the interval since the last log held a validation or a checkpoint
        paced: list[tuple[int, int, int, float]] = []  # training-only logged intervals
        logged = self.state.step
        stop = min(self.train.steps, self.train.exit_at_step or self.train.steps)
        while self.state.step < stop:
            result = self.step(self.data.next_step())
            self.state.step += 1
            profiler.step()
            bar.update(1)
            first, last = first or result, result
            unread.append(result)
            validation = self.data.validation() if self._eval_due() else None
            log = self._log_due() or validation is not None
            if not (log or self._saves() or self.state.step == stop):
                continue  # a step that reads nothing: the host runs ahead of the device
            # Reading the results waits for the device once (and counts skipped steps).
            tokens = sum(r.num_tokens for r in unread)
            unread.clear()
            self.state.tokens_seen += tokens
            tokens_since_log += tokens
            if log:
                record = {"loss": result.loss, "lr": self.step.parts.scheduler.get_last_lr()}
                record.update(grad_norm=result.grad_norm, **result.metrics)
                record.update(getattr(self.data, "step_metrics", {}))
                if validation is not None:
                    record["valid_loss"] = self.step.evaluate(validation)
                self._log(metrics, meter, bar, record, tokens_since_log)
                if not (busy or "valid_loss" in record):
                    seconds = tokens_since_log / max(record["tokens_per_s"], 1e-9)
                    paced.append((logged + 1, self.state.step, tokens_since_log, seconds))
                tokens_since_log, busy, logged = 0, False, self.state.step
            busy |= self.checkpoints.save(self.state.step)
            self._export_hf()
        bar.close()
        windows = throughput_windows(paced, self.checkpoints.interval, self.state.step)
        return {"first_loss": first and first.loss, "final_loss": last and last.loss,
                "steps": self.state.step, "tokens_per_s": windows}  # fmt: skip

    def _log(self, metrics, meter, bar, record: dict, tokens: int) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rate = meter.update(tokens // world)
        record.update(
            tokens_per_s=rate["tokens_per_s"] * world,
            mfu=rate["mfu"],
            mem_gb=dev.memory_stats(self.step.model.device)["peak_gb"],
        )
        metrics.log(self.state.step, record)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            mfu=f"{rate['mfu']:.1%}",
        )

    def _export_hf(self) -> None:
        """`logging.hf_export_every`: this step's checkpoint as a Hugging Face folder, written
        on rank 0 by `mindspeed convert`'s writer (the others meet it at their next collective)."""
        every, step = getattr(self.logging, "hf_export_every", 0), self.state.step
        if not every or step % every:
            return
        self.checkpoints.wait()  # an asynchronous save must be whole first
        if is_rank0():
            lora = getattr(getattr(self.cfg, "lora", None), "rank", 0) > 0
            export_hf(self.checkpoints.folder / f"step_{step}", self.run_dir.path / "hf" / f"step_{step}",
                      merge_lora=lora)  # fmt: skip

    def _saves(self) -> bool:
        """Whether this step writes a checkpoint or a Hugging Face export (the counters in
        them must be current)."""
        every = getattr(self.logging, "hf_export_every", 0)
        return self.checkpoints.should_save(self.state.step) or bool(
            every and self.state.step % every == 0
        )

    def _log_due(self) -> bool:
        interval = self.logging.log_interval
        return self.state.step % max(interval, 1) == 0 or self.state.step == self.train.steps

    def _eval_due(self) -> bool:
        interval = self.train.eval_interval
        if interval <= 0:
            return False
        return self.state.step % interval == 0 or self.state.step == self.train.steps

    def _finish(self) -> None:
        interval = self.checkpoints.interval
        if interval == 0 or self.state.step % interval:
            self.checkpoints.save(self.state.step, force=True)
        self.checkpoints.close()
        self.run_dir.finish()


def throughput_windows(
    paced: list[tuple[int, int, int, float]], interval: int, last_step: int
) -> dict[str, float]:
    """Tokens/s before and after the first checkpoint, "30-90" and "110-300" for the demo:
    over steps 0.3-0.9 and 1.1 of the checkpoint `interval` to the last step (the whole run
    without an interval, or when it stopped before 1.1 of it). `paced` holds the logged
    intervals (first step, last step, tokens, seconds) that ran only training steps (no
    validation, no checkpoint); a window counts those that lie inside it."""
    if interval and last_step > interval * 11 // 10:
        spans = [(interval * 3 // 10, interval * 9 // 10), (interval * 11 // 10, last_step)]
    else:
        spans = [(0, last_step)]
    out = {}
    for low, high in spans:
        inside = [(tokens, seconds) for first, last, tokens, seconds in paced
                  if low < first and last <= high]  # fmt: skip
        if inside:
            out[f"{low}-{high}"] = sum(t for t, _ in inside) / sum(s for _, s in inside)
    return out


def export_hf(step_dir: Path, out: Path, *, merge_lora: bool = False) -> None:
    """`mindspeed convert --to hf` of one checkpoint, in this process
    (`mindspeed_llm.hf_export`); an existing `out` (a resumed run exporting again) is kept.
    Nothing is gathered: this rank keeps its own shards while the writer reads the checkpoint
    one tensor at a time (merging a LoRA run's adapters into each base tensor likewise)."""
    if out.exists():
        return
    write = merge_lora_to_hf if merge_lora else mindspeed_to_hf
    try:
        write(step_dir, out)
    except MindSpeedError as err:
        raise TrainingError(
            f"logging.hf_export_every: exporting {step_dir} to {out} failed: {err}"
        ) from None
    logger.info("exported %s as a Hugging Face folder: %s", step_dir.name, out)


def peak_per_rank(device) -> list[float]:
    """Every rank's peak memory in GiB (allocator peak on accelerators, peak resident set on
    CPU), in rank order: a collective, so every rank calls it."""
    return per_rank(dev.memory_stats(device)["peak_gb"])


def per_rank(value: float) -> list[float]:
    """Every rank's `value`, in rank order (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
