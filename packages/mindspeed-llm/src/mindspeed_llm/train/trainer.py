"""A trainer is a config, a data source and an objective; `Trainer` puts the pieces together.

Read top to bottom: `Trainer.__init__` checks everything a user can get wrong before
anything is written or any process group exists (model, data, layout, batch sizes),
then builds the data of this rank, the model on its layout (`build`), the optimizer
step (`step`) and the checkpoints; `run` hands them to the loop (`loop`). Without a
data source and an objective it pretrains: GPT data and next-token cross entropy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindspeed_core.distributed import DistributedInfo
from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.parallel import ParallelConfig, check_microbatches
from mindspeed_core.training import check_wandb
from mindspeed_llm.models.common.layout import check_layout
from mindspeed_llm.models.common.parallelize import ModelHook
from mindspeed_llm.train.build import BuiltModel, build_model, build_train_parts, model_config
from mindspeed_llm.train.compile import check_cuda_graphs
from mindspeed_llm.train.config import TrainSection
from mindspeed_llm.train.loop import DataSource, TrainLoop, peak_per_rank, per_rank
from mindspeed_llm.train.objectives import NextToken, Objective, RunContext
from mindspeed_llm.train.pretrain_data import PretrainData
from mindspeed_llm.train.run_dir import RunDirectory
from mindspeed_llm.train.start import StartingWeights, load_init_state
from mindspeed_llm.train.step import TrainingError, TrainStep

__all__ = [
    "Trainer",
    "TrainingError",
    "grad_accum_steps",
    "load_init_state",
    "pipeline_microbatches",
]


class Trainer:
    """One training run.

    Args:
        cfg: a config with `model`, `data` (with `seq_len`), `parallel`, `optim`, `train`,
            `checkpoint`, `logging` and `profile` sections, e.g. `PretrainConfig`.
        info: this process's place (`mindspeed_core.distributed.init_distributed()`).
        data: `data(cfg, model_config)` -> a `DataSource` with `build(dims, accum)`;
            default: pretraining's `PretrainData`.
        objective: default: `NextToken(cfg.train.loss_normalization)`.
        before_tp / after_tp: model hooks (a new head; adapters), see `build_model`.
        adapter_only: checkpoints hold only the trainable parameters (LoRA adapters over
            a frozen base rebuilt from `model.hf_path` or the seed); see
            `mindspeed_llm.peft.lora_trainer_options`.
        init_state: starting weights (a model state dict, e.g. a demo's warm start) loaded
            into the policy when it is built; under `adapter_only` the adapters may be
            missing from it.
        init_from: a folder of starting weights (Hugging Face or a run's checkpoints) loaded
            into the policy after `init_state`; `init_from_key` is the config field that
            named it (errors say it). Both make the run's `StartingWeights`, which
            `RunContext.starting_policy` gives every model built as the policy started.
        command: names the progress bar.

    A method's extra roles (a frozen reference, a critic, a rollout step) are created by its
    objective in `Objective.setup` and `Objective.build_step`, which get a `RunContext`;
    nothing is assigned into a built trainer.
    """

    def __init__(
        self,
        cfg: Any,
        info: DistributedInfo,
        *,
        data: Callable[[Any, Any], DataSource] | None = None,
        objective: Objective | None = None,
        before_tp: ModelHook | None = None,
        after_tp: ModelHook | None = None,
        command: str = "pretrain",
        adapter_only: bool = False,
        init_state: dict[str, Any] | None = None,
        init_from: Path | None = None,
        init_from_key: str = "init_from",
    ):
        data = data or PretrainData
        self.cfg, self.device, self.command = cfg, info.device, command
        check_wandb(cfg.logging.wandb_options())
        _check_hf_export(cfg)
        self.model_cfg = model_config(cfg.model)
        check_cuda_graphs(cfg.train.cuda_graphs, cfg.train.compile, info.device, self.model_cfg)
        check_layout(
            self.model_cfg, cfg.parallel, seq_len=cfg.data.seq_len, recompute=cfg.train.ac != "none"
        )
        _check_token_budget(cfg)
        self.dims = cfg.parallel.dims()
        self.accum = grad_accum_steps(cfg.train, self.dims.dp)
        n_microbatches = pipeline_microbatches(cfg.parallel, cfg.train, self.accum)
        self.data = data(cfg, self.model_cfg)
        self.dims.build(self.device.type)  # the first process groups: after every check
        self.data.build(self.dims, self.accum)
        self.parts = self._build_parts(before_tp, after_tp, adapter_only)
        self.model = self.parts.model.model
        self.state = self.parts.state
        start = None
        if init_state is not None or init_from is not None:
            start = StartingWeights(init_state, init_from, init_from_key, partial=adapter_only)
            start.give(self.parts.model)
        objective = objective or NextToken(cfg.train.loss_normalization)
        self.states = self.parts.states(self.data, self.device)
        self.checkpoints = cfg.checkpoint.manager(self.states, cfg.logging.run_dir)
        self.objective = objective
        run = RunContext(
            cfg, self.dims, self.model_cfg, self.device, self.data, self.parts.model,
            self.build_model, self.add_states, parts=self.parts, accum=self.accum,
            start=start,
            step_options={"clip_grad": cfg.optim.clip_grad, "n_microbatches": n_microbatches,
                          "max_nonfinite_steps": cfg.train.max_nonfinite_steps,
                          "fused_linear_cross_entropy": cfg.train.fused_linear_cross_entropy},
        )  # fmt: skip
        objective.setup(run)
        self.step: TrainStep = objective.build_step(run) or TrainStep(
            self.parts, objective, self.dims, **run.step_options
        )
        # Every model of the run built and its weights in (collective; logged by the loop).
        self.startup_peak_gb = peak_per_rank(self.device)

    def build_model(self, **options) -> BuiltModel:
        """Another model of this run (a frozen reference, a critic): the run's model config,
        layout, device, seed, precision, sequence length and starting weights; `options` are
        `build.build_model`'s and win (`frozen=True`, `before_tp=add_score_head`, ...)."""
        cfg = self.cfg
        run = {"parallel": cfg.parallel, "precision": cfg.train.precision, "seed": cfg.train.seed,
               "seq_len": cfg.data.seq_len, "hf_path": cfg.model.hf_path}  # fmt: skip
        return build_model(self.model_cfg, self.dims, self.device, **{**run, **options})

    def _build_parts(self, before_tp, after_tp, adapter_only=False):
        cfg = self.cfg
        model = self.build_model(
            ac=cfg.train.ac,
            seq_len=self.data.seq_len,
            before_tp=before_tp,
            after_tp=after_tp,
            compile=cfg.train.compile,
            cuda_graphs=cfg.train.cuda_graphs,
            fp8=cfg.train.fp8,
        )
        return build_train_parts(
            model,
            cfg.optim,
            total_steps=cfg.train.steps,
            precision=cfg.train.precision,
            adapter_only=adapter_only,
        )

    def add_states(self, states: dict[str, Any]) -> None:
        """More `Stateful`s for the run's checkpoints (e.g. a PPO critic's model and
        optimizer), saved and resumed with the others; call before `run`."""
        clash = set(states) & set(self.states)
        if clash:
            raise ValueError(f"checkpoint states {sorted(clash)} exist already")
        self.states.update(states)
        self.checkpoints.states.update(states)

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the first and last logged loss."""
        loop = TrainLoop(
            self.step,
            self.data,
            checkpoints=self.checkpoints,
            run_dir=RunDirectory(
                self.cfg.logging.run_dir,
                tensorboard=self.cfg.logging.tensorboard,
                wandb=self.cfg.logging.wandb_options(),
            ),
            cfg=self.cfg,
            train=self.cfg.train,
            logging=self.cfg.logging,
            load=self.cfg.checkpoint.load,
            command=self.command,
            profile=self.cfg.profile,
            startup_peak_gb=self.startup_peak_gb,
        )
        summary = loop.run()
        summary["startup_peak_gb_per_rank"] = self.startup_peak_gb
        summary["optimizer_state_gb_per_rank"] = per_rank(
            self.parts.optimizer.state_bytes() / 2**30
        )
        return summary


def _check_hf_export(cfg) -> None:
    """`logging.hf_export_every` exports checkpoints: it must fall on them."""
    every = getattr(cfg.logging, "hf_export_every", 0)
    if not every:
        return
    interval = cfg.checkpoint.interval
    if every < 0 or not interval or every % interval:
        raise ConfigError(f"logging.hf_export_every={every} must be a positive multiple of "
                          f"checkpoint.interval={interval} (it exports those checkpoints)")  # fmt: skip


def _check_token_budget(cfg) -> None:
    """`train.micro_batch_tokens` makes micro-batches of varying shapes and counts per step:
    torch's pipeline schedules take a fixed count of one shape."""
    budget = cfg.train.micro_batch_tokens
    if budget is not None and cfg.parallel.pp > 1:
        raise ConfigError(f"train.micro_batch_tokens={budget} needs parallel.pp=1 (a pipeline "
                          "schedule takes micro-batches of one shape); use train.micro_batch")  # fmt: skip


def grad_accum_steps(train: TrainSection, dp: int) -> int:
    """Micro-batches per step on each data-parallel rank (1 under `train.micro_batch_tokens`:
    the data source packs each step's samples into as many as the budget needs)."""
    if train.micro_batch_tokens is not None:
        return 1
    per_step = train.micro_batch * dp
    if train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={train.global_batch} is not divisible by train.micro_batch "
            f"({train.micro_batch}) x data-parallel size ({dp}) = {per_step}"
        )
    return train.global_batch // per_step


def pipeline_microbatches(parallel: ParallelConfig, train: TrainSection, accum: int) -> int | None:
    """Microbatches per pipeline step (pp > 1): `parallel.pp_microbatches` or `accum`,
    checked against the samples of a step and the schedule."""
    if parallel.pp == 1:
        return None
    n = parallel.pp_microbatches or accum
    samples = accum * train.micro_batch  # this rank's samples per step
    if samples % n:
        raise ConfigError(
            f"parallel.pp_microbatches={n} must divide the {samples} samples a "
            f"rank takes per step (train.global_batch / data-parallel size)"
        )
    try:
        num_stages = parallel.pp * parallel.virtual_stages
        check_microbatches(parallel.pp_schedule, n, parallel.pp, num_stages)
    except ParallelError as err:
        raise ConfigError(f"parallel.pp={parallel.pp}: {err}") from None
    return n
