"""The pretraining loop: config -> run directory -> steps -> metrics and checkpoints.

Read top to bottom: `Trainer.__init__` checks everything a user can get wrong
before anything is written, then builds data, model (parallelised from outside by
mindspeed_core), optimizer and checkpoints; `run` trains. The run directory holds
`config.yaml`, `metrics.jsonl`, `tb/`, `checkpoints/` and `loss_curve.png`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import mindspeed_ops
from mindspeed_core import device as dev
from mindspeed_core.checkpoint import CheckpointManager, ModelState, RNGState, TrainState
from mindspeed_core.config import dump_yaml
from mindspeed_core.distributed import DistributedInfo, is_rank0
from mindspeed_core.errors import ConfigError, MindSpeedError, ParallelError
from mindspeed_core.optim import (
    DynamicLossScaler,
    build_lr_schedulers,
    build_optimizers,
    clip_grad_norm_,
)
from mindspeed_core.parallel import (
    ParallelDims,
    build_pipeline_schedule,
    check_pipeline,
    cp_degrees,
    gather_tokens,
    loss_parallel_context,
    packed_shard_index,
)
from mindspeed_core.parallel.context_parallel import check_cp_heads
from mindspeed_core.training import (
    MetricsWriter,
    ThroughputMeter,
    flops_per_token,
    set_seed,
)
from mindspeed_llm.data import build_pretrain_datasets, packed_positions
from mindspeed_llm.models import build_model_config, checkpoint_io, get_model_spec
from mindspeed_llm.models.common.moe import LoadTracker, active_params, moe_aux_loss
from mindspeed_llm.models.hf_io import load_hf_weights, read_hf_config
from mindspeed_llm.tokenizer import load_tokenizer
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.loader import PretrainLoader
from mindspeed_llm.train.plots import plot_loss_curve

logger = logging.getLogger("mindspeed.pretrain")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(MindSpeedError):
    """Training cannot go on (e.g. the loss stayed inf/nan)."""


class Trainer:
    def __init__(self, cfg: PretrainConfig, info: DistributedInfo):
        self.cfg = cfg
        self.device = info.device
        self.model_cfg = _model_config(cfg)
        _check_pipeline(cfg, self.model_cfg)  # pp against the layers, before the world size
        _check_context_parallel(cfg, self.model_cfg)  # likewise
        self.dims = ParallelDims(
            dp_replicate=cfg.parallel.dp_replicate,
            dp_shard=cfg.parallel.dp_shard,
            tp=cfg.parallel.tp,
            ep=cfg.parallel.ep,
            pp=cfg.parallel.pp,
            cp=cfg.parallel.cp,
        )
        self.accum = _grad_accum_steps(cfg, self.dims.dp)
        tokenizer_path, self.data_paths = _resolve_data(cfg)
        # config.yaml records the tokenizer the data was made with, so `mindspeed generate`
        # on this run's checkpoints decodes with it (not model.hf_path's).
        cfg.data.tokenizer = tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        _check_fits(cfg, self.model_cfg, self.tokenizer, tokenizer_path)
        _check_experts(cfg, self.model_cfg)
        self.pp_microbatches = _check_pipeline(cfg, self.model_cfg, self.accum)
        self.dims.build(self.device.type)  # the first process groups: after every check
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._build_checkpointing()
        self.run_dir = Path(cfg.logging.run_dir)

    # -- construction ---------------------------------------------------------------

    def _build_data(self) -> None:
        cfg = self.cfg
        eval_samples = cfg.train.eval_batches * cfg.train.global_batch
        train, valid, _ = build_pretrain_datasets(
            self.data_paths,
            split=cfg.data.split,
            seq_len=cfg.data.seq_len,
            seed=cfg.train.seed,
            num_samples=(cfg.train.steps * cfg.train.global_batch, eval_samples, 0),
            cache_dir=cfg.data.cache_dir,
        )
        loader_args = {
            "micro_batch": cfg.train.micro_batch,
            "dp_rank": self.dims.rank("dp"),
            "dp_size": self.dims.dp,
        }
        self.loader = PretrainLoader(train, **loader_args)
        self.valid = valid
        self.valid_args = loader_args

    def _build_model(self) -> None:
        cfg, mcfg = self.cfg, self.model_cfg
        # The same seed on every pipeline stage: each builds the whole model, then keeps
        # its own layers, so every layout starts from one process's weights.
        set_seed(cfg.train.seed, self.dims, vary_along=())
        spec = get_model_spec(mcfg.family)
        with torch.device(self.device):
            model = spec.build(mcfg)
        if cfg.model.hf_path is not None:  # whole, before any split or sharding
            load_hf_weights(model, cfg.model.hf_path, mcfg)
        self.flops_per_token = flops_per_token(  # MoE: only the top_k experts a token uses
            active_params(model), mcfg.num_layers, mcfg.hidden_size, cfg.data.seq_len
        )
        dtype = _DTYPES[cfg.train.precision]
        sharded = self.dims.fsdp_enabled or self.dims.dp_replicate > 1
        self.autocast = dtype != torch.float32 and not sharded
        self.loss_parallel = self.dims.tp > 1 and cfg.parallel.loss_parallel
        options = {
            "ac_mode": cfg.train.ac,
            "param_dtype": dtype if dtype != torch.float32 else None,
            "sequence_parallel": self.dims.tp > 1 and cfg.parallel.sequence_parallel,
            "loss_parallel": self.loss_parallel,
        }
        if self.dims.cp > 1:
            options.update(cp_mode=cfg.parallel.cp_mode, ulysses_degree=cfg.parallel.ulysses_degree)
        self.pipeline = self.schedule = None
        if self.dims.pp > 1:
            self._build_pipeline(spec, model, options)
        else:
            self.model = spec.parallelize(model, self.dims, **options)
            self.model_parts = [self.model]
        self.scaler = DynamicLossScaler() if cfg.train.precision == "fp16" else None
        self.load_tracker = (
            LoadTracker(self.model, mcfg.router_bias_update_rate) if mcfg.num_experts else None
        )

    def _build_pipeline(self, spec, model, options: dict) -> None:
        """This rank's stages (TP/AC/FSDP inside each) and the schedule that runs them."""
        p = self.cfg.parallel
        if spec.pipeline is None:
            raise ConfigError(f"model.family={spec.name} does not support parallel.pp > 1")
        self.pipeline = spec.pipeline(
            model,
            self.dims,
            device=self.device,
            schedule=p.pp_schedule,
            stages_per_rank=p.virtual_stages,
            layers_per_stage=p.layers_per_stage or None,
            **options,
        )
        self.model, self.model_parts = None, self.pipeline.model_parts
        self.schedule = build_pipeline_schedule(
            self.pipeline.stages, self.pp_microbatches, self._pipeline_loss, p.pp_schedule
        )

    def _build_optimizer(self) -> None:
        o, steps = self.cfg.optim, self.cfg.train.steps
        self.optimizer = build_optimizers(
            self.model_parts,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=tuple(o.betas),
            eps=o.eps,
            implementation=o.implementation,
        )
        self.scheduler = build_lr_schedulers(
            self.optimizer,
            warmup_steps=o.warmup_steps,
            total_steps=steps,
            decay_style=o.decay_style,
            min_lr_ratio=o.min_lr_ratio,
            decay_steps=o.decay_steps,
        )

    def _build_checkpointing(self) -> None:
        c = self.cfg.checkpoint
        self.state = TrainState()
        states = {
            "model": ModelState(self.model_parts),
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "train": self.state,
            "data": self.loader,
            "rng": RNGState(self.device),
        }
        if self.scaler is not None:
            states["loss_scaler"] = self.scaler
        folder = c.dir or Path(self.cfg.logging.run_dir) / "checkpoints"
        self.checkpoints = CheckpointManager(
            states, folder, interval=c.interval, keep_last=c.keep_last, async_save=c.async_save
        )
        self.states = states

    # -- running --------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the first and last logged loss."""
        resumed = self._maybe_resume()
        if is_rank0():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(self.cfg, self.run_dir / "config.yaml")
        metrics = MetricsWriter(
            self.run_dir, tensorboard=self.cfg.logging.tensorboard, resume_step=resumed
        )
        try:
            summary = self._loop(metrics)
        finally:
            metrics.close()
        self._finish()
        return summary

    def _maybe_resume(self) -> int | None:
        load = self.cfg.checkpoint.load
        if load == "none":
            return None
        if load == "auto" or self.checkpoints.latest_step() is not None:
            # The run's own checkpoints win: running the same command again (or after
            # train.exit_at_step) continues the run instead of starting over from `load`.
            step = self.checkpoints.load()
        else:
            step = _load_from(Path(load), self.states)
            if step is None:  # model weights only: a fresh run starting at step 0
                step = 0
        if step is not None:
            logger.info("resumed from step %d", self.state.step)
        return step

    def _loop(self, metrics: MetricsWriter) -> dict[str, float]:
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        peak = dev.peak_flops(self.device, _DTYPES[cfg.train.precision])
        meter = ThroughputMeter(self.flops_per_token, peak)
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.state.step,
            disable=not (is_rank0() and cfg.logging.progress),
            desc="pretrain",
            dynamic_ncols=True,
        )
        first = last = None
        steps_since_log = 0
        stop = min(cfg.train.steps, cfg.train.exit_at_step or cfg.train.steps)
        while self.state.step < stop:
            loss, grad_norm = self._train_step()
            self.state.step += 1
            self.state.tokens_seen += tokens_per_step
            steps_since_log += 1
            bar.update(1)
            record = {"loss": loss, "lr": self.scheduler.get_last_lr(), "grad_norm": grad_norm}
            record.update(self._router_step())
            if self._eval_due():
                record["valid_loss"] = self._evaluate()
            if self._log_due() or "valid_loss" in record:
                rate = meter.update(tokens_per_step * steps_since_log // dist.get_world_size())
                steps_since_log = 0
                record.update(
                    tokens_per_s=rate["tokens_per_s"] * dist.get_world_size(),
                    mfu=rate["mfu"],
                    mem_gb=dev.memory_stats(self.device)["peak_gb"],
                )
                metrics.log(self.state.step, record)
                bar.set_postfix(
                    loss=f"{loss:.3f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    mfu=f"{rate['mfu']:.1%}",
                )
            first = loss if first is None else first
            last = loss
            self.checkpoints.save(self.state.step)
        bar.close()
        return {"first_loss": first, "final_loss": last, "steps": self.state.step}

    def _log_due(self) -> bool:
        interval = self.cfg.logging.log_interval
        return self.state.step % max(interval, 1) == 0 or self.state.step == self.cfg.train.steps

    def _eval_due(self) -> bool:
        interval = self.cfg.train.eval_interval
        if self.valid is None or interval <= 0:
            return False
        return self.state.step % interval == 0 or self.state.step == self.cfg.train.steps

    def _train_step(self) -> tuple[float, float]:
        self.optimizer.zero_grad()
        if self.schedule is not None:
            total = self._pipeline_step(self.loader, train=True)
        else:
            total = self._forward_backward()
        loss = self._mean_over_data(total)
        if not math.isfinite(loss):
            return self._skip_step(loss)
        self.state.extra["nonfinite_in_a_row"] = 0
        params = list(self.optimizer.parameters())
        if self.scaler is not None:
            found_inf = self.scaler.unscale_(params)
            self.scaler.update(found_inf)
            if found_inf:  # the fp16 gradients overflowed: skip, the scale went down
                self.optimizer.zero_grad()
                self.scheduler.step()
                return loss, float("nan")
        grad_norm = clip_grad_norm_(params, self.cfg.optim.clip_grad, pp_mesh=self.dims.mesh("pp"))
        self.optimizer.step()
        self.scheduler.step()
        return loss, float(grad_norm)

    def _skip_step(self, loss: float) -> tuple[float, float]:
        count = self.state.extra.get("nonfinite_in_a_row", 0) + 1
        self.state.extra["nonfinite_in_a_row"] = count
        self.state.extra["nonfinite_total"] = self.state.extra.get("nonfinite_total", 0) + 1
        self.optimizer.zero_grad()
        logger.warning(
            "step %d: loss is %s; skipped (%d in a row)", self.state.step + 1, loss, count
        )
        if count >= self.cfg.train.max_nonfinite_steps:
            raise TrainingError(
                f"the loss was inf/nan for {count} steps in a row (up to step {self.state.step + 1}); "
                "lower optim.lr, raise optim.warmup_steps or use train.precision bf16/fp32"
            )
        return loss, float("nan")

    def _compute_context(self):
        stack = contextlib.ExitStack()
        if self.autocast:
            dtype = _DTYPES[self.cfg.train.precision]
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        stack.enter_context(loss_parallel_context(self.loss_parallel))
        return stack

    def _forward_backward(self) -> torch.Tensor:
        """Gradient accumulation over this step's micro-batches; the local mean loss."""
        total = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            batch = self.loader.next_micro_batch().to(self.device)
            with self._compute_context():
                loss = self._loss(batch) / self.accum
                aux = self._router_aux_loss()
                objective = loss if aux is None else loss + aux / self.accum
                (self.scaler.scale_loss(objective) if self.scaler else objective).backward()
            total += _plain(loss).detach()
        return total

    def _pipeline_step(self, loader: PretrainLoader, *, train: bool) -> torch.Tensor:
        """One schedule step (or forward-only pass) over a step's worth of samples.

        Every pipeline rank reads the same samples: the first stage takes the tokens,
        the last the labels, and every stage the positions and document boundaries
        (torch's schedules pass `kwarg_mbs` to each stage's forward). Returns the mean
        loss, on every pipeline rank (the last stage's value, summed over the pp group).
        """
        batch = torch.cat([loader.next_micro_batch() for _ in range(self.accum)])
        args, kwargs, targets = [], [], []
        for mb in batch.to(self.device).chunk(self.pp_microbatches):
            tokens, positions, cu_seqlens = self._inputs(mb)
            args.append((tokens,))
            kwargs.append({"position_ids": positions, "cu_seqlens": cu_seqlens})
            targets.append(mb[:, 1:])
        losses: list[torch.Tensor] = []  # filled on the last stage, one per microbatch
        with self._compute_context():
            if train:  # the losses are all we need: do not keep every microbatch's logits
                self.schedule.step(
                    arg_mbs=args,
                    kwarg_mbs=kwargs,
                    target_mbs=targets,
                    losses=losses,
                    return_outputs=False,
                )
            else:
                self.schedule.eval(
                    arg_mbs=args, kwarg_mbs=kwargs, target_mbs=targets, losses=losses
                )
        total = torch.zeros((), device=self.device)
        if losses:
            scale = self.scaler.scale if self.scaler else 1.0
            total += torch.stack([_plain(x).detach() for x in losses]).mean() / scale
        dist.all_reduce(total, group=self.dims.mesh("pp").get_group())
        return total

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: mean loss of one microbatch (scaled for fp16).

        torch also calls it once on placeholder tensors to infer gradient shapes, so
        the losses to report come from the schedule's `losses` list, not from here.
        """
        loss = self._cross_entropy(logits, labels)
        return self.scaler.scale_loss(loss) if self.scaler else loss

    def _inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, position_ids, cu_seqlens) of a (batch, seq + 1) sample block."""
        tokens = batch[:, :-1]
        positions, cu_seqlens = packed_positions(
            tokens,
            -1 if self.tokenizer.eod_id is None else self.tokenizer.eod_id,
            reset_position_ids=self.cfg.data.reset_position_ids,
            reset_attention_mask=self.cfg.data.reset_attention_mask,
        )
        return tokens, positions, cu_seqlens

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        tokens, positions, cu_seqlens = self._inputs(batch)
        if self.dims.cp > 1:
            return self._cp_loss(tokens, batch[:, 1:], positions, cu_seqlens)
        logits = self.model(tokens, position_ids=positions, cu_seqlens=cu_seqlens)
        return self._cross_entropy(logits, batch[:, 1:])

    def _cp_loss(self, tokens, labels, positions, cu_seqlens) -> torch.Tensor:
        """Context parallel: the model sees this rank's zig-zag share of every document
        (padding labelled -100) at global positions. The loss is the local token sum /
        the micro-batch's token count x cp: FSDP over dp_shard x cp averages gradients
        over the cp ranks too, and the mean over the loss mesh is then the true mean."""
        cp = self.dims.cp
        index, local_cu = packed_shard_index(cu_seqlens, self.dims.rank("cp"), cp)
        local = [
            gather_tokens(t.flatten(), index, pad)[None]
            for t, pad in ((tokens, 0), (labels, -100), (positions, 0))
        ]
        logits = self.model(local[0], position_ids=local[2], cu_seqlens=local_cu)
        return self._cross_entropy(logits, local[1], reduction="sum") * cp / labels.numel()

    def _cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
    ) -> torch.Tensor:
        if self.loss_parallel:  # vocab-sharded DTensor logits: torch's loss-parallel kernel
            return F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction
            )
        return mindspeed_ops.cross_entropy(
            logits.flatten(0, 1),
            labels.flatten(),
            reduction=reduction,
            impl=self.cfg.model.ops_impl,
        )

    def _router_aux_loss(self) -> torch.Tensor | None:
        """MoE: the router losses of the forward just run (added to the loss, not
        reported in it), after noting its expert loads."""
        if self.load_tracker is None:
            return None
        aux = moe_aux_loss(self.model, self.model_cfg)
        self.load_tracker.observe(aux)
        return aux

    def _router_step(self) -> dict:
        """MoE: expert-load metrics of the step over every data rank; updates the
        aux-loss-free router biases."""
        if self.load_tracker is None:
            return {}
        mesh = self.dims.mesh("loss")
        return self.load_tracker.step(None if mesh is None else mesh.get_group())

    def _mean_over_data(self, value: torch.Tensor) -> float:
        mesh = self.dims.mesh("loss")
        if mesh is not None:
            value = value.clone()
            dist.all_reduce(value, group=mesh.get_group())
            value /= mesh.size()
        return value.item()

    @torch.no_grad()
    def _evaluate(self) -> float:
        loader = PretrainLoader(self.valid, **self.valid_args)  # the same samples every time
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:  # forward only through the schedule, a step at a time
            for _ in range(self.cfg.train.eval_batches):
                total += self._pipeline_step(loader, train=False)
            return self._mean_over_data(total / self.cfg.train.eval_batches)
        micro_batches = self.cfg.train.eval_batches * self.accum  # whole global batches
        for _ in range(micro_batches):
            with self._compute_context():
                total += _plain(self._loss(loader.next_micro_batch().to(self.device)))
        return self._mean_over_data(total / micro_batches)

    def _finish(self) -> None:
        if self.cfg.checkpoint.interval == 0 or self.state.step % self.cfg.checkpoint.interval:
            self.checkpoints.save(self.state.step, force=True)
        self.checkpoints.close()
        if is_rank0():
            plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; take its value."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad_accum_steps(cfg: PretrainConfig, dp: int) -> int:
    per_step = cfg.train.micro_batch * dp
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by train.micro_batch "
            f"({cfg.train.micro_batch}) x data-parallel size ({dp}) = {per_step}"
        )
    return cfg.train.global_batch // per_step


def _check_pipeline(cfg: PretrainConfig, model_cfg, accum: int | None = None) -> int | None:
    """Pipeline settings against the model and (given `accum`) the batch; returns the
    microbatches per schedule step."""
    p = cfg.parallel
    if p.pp == 1:
        for name, value, default in (
            ("virtual_stages", p.virtual_stages, 1),
            ("layers_per_stage", p.layers_per_stage, []),
            ("pp_microbatches", p.pp_microbatches, None),
        ):
            if value != default:
                raise ConfigError(f"parallel.{name}={value} needs parallel.pp > 1")
        return accum
    n_microbatches = None if accum is None else p.pp_microbatches or accum
    if accum is not None and (accum * cfg.train.micro_batch) % n_microbatches:
        samples = accum * cfg.train.micro_batch  # this rank's samples per step
        raise ConfigError(
            f"parallel.pp_microbatches={n_microbatches} must divide the {samples} samples a "
            f"rank takes per step (train.global_batch / data-parallel size)"
        )
    if model_cfg.tie_word_embeddings:
        raise ConfigError(
            "parallel.pp > 1 with a model that ties its input and output embeddings is not "
            "supported: they would sit on different stages"
        )
    try:
        check_pipeline(
            num_layers=model_cfg.num_layers,
            pp=p.pp,
            stages_per_rank=p.virtual_stages,
            schedule=p.pp_schedule,
            layers_per_stage=p.layers_per_stage or None,
            n_microbatches=n_microbatches,
            recompute=cfg.train.ac != "none",
        )
    except ParallelError as err:
        raise ConfigError(f"parallel.pp={p.pp}: {err}") from None
    return n_microbatches


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


def _check_context_parallel(cfg: PretrainConfig, model_cfg) -> None:
    """Context parallel layouts the model and data allow (before any process group)."""
    p = cfg.parallel
    if p.cp == 1:
        return
    if p.pp > 1:
        raise ConfigError(f"parallel.cp={p.cp} with parallel.pp={p.pp} is not supported yet")
    if cfg.data.seq_len % (2 * p.cp):
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by 2 x parallel.cp = {2 * p.cp}: "
            "context parallel cuts every sequence into 2 x cp zig-zag chunks"
        )
    ring, ulysses = cp_degrees(p.cp, p.cp_mode, p.ulysses_degree)
    heads, kv_heads = model_cfg.num_heads // p.tp, max(model_cfg.num_kv_heads // p.tp, 1)
    try:
        check_cp_heads(heads, kv_heads, ulysses)
    except ParallelError as err:
        raise ConfigError(f"parallel.cp_mode={p.cp_mode} with parallel.cp={p.cp}: {err}") from None
    if ring > 1 and model_cfg.sliding_window is not None:
        raise ConfigError(
            f"the model's sliding_window={model_cfg.sliding_window} needs "
            f"parallel.cp_mode=ulysses (ring attention has no windows), got {p.cp_mode}"
        )


def _check_experts(cfg: PretrainConfig, model_cfg) -> None:
    """MoE layouts we build, checked before any process group exists."""
    p, num_experts = cfg.parallel, model_cfg.num_experts
    if p.ep > 1 and not num_experts:
        raise ConfigError(
            f"parallel.ep={p.ep} needs a MoE model; model.family={model_cfg.family} has no experts"
        )
    if num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the model's num_experts={num_experts}")
    if num_experts and (p.tp > 1 or p.pp > 1 or p.cp > 1):
        raise ConfigError(
            f"parallel.tp={p.tp}, parallel.pp={p.pp}, parallel.cp={p.cp}: MoE models support "
            "only tp=1, pp=1 and cp=1 yet (use parallel.ep and dp_shard)"
        )
    if p.ep > 1 and p.dp_replicate > 1:
        raise ConfigError(
            f"parallel.ep={p.ep} with parallel.dp_replicate={p.dp_replicate} is not supported yet"
        )


def _load_from(path: Path, states) -> int | None:
    """checkpoint.load given as a folder of checkpoints or one step_<N> folder.

    A checkpoint holding only the model (e.g. from `mindspeed convert`) gives the weights;
    training then starts at step 0 with a fresh optimizer (returns None).
    """
    is_step = path.name.startswith("step_") and path.name[5:].isdigit()
    root = path.parent if is_step else path
    step = int(path.name[5:]) if is_step else CheckpointManager(states, root).latest_step()
    if step is None:
        raise ConfigError(f"checkpoint.load={path} holds no checkpoint")
    if checkpoint_io.saved_states(root / f"step_{step}") == {"model"}:
        CheckpointManager({"model": states["model"]}, root).load(step)
        logger.info("loaded the model weights of %s; training starts at step 0", path)
        return None
    return CheckpointManager(states, root).load(step)


def _model_config(cfg: PretrainConfig):
    """The model to build: from model.hf_path's config.json, model.hf_config, or a flavor."""
    m = cfg.model
    if m.hf_path is not None:
        return read_hf_config(m.hf_path, ops_impl=m.ops_impl)
    flavor = None if m.hf_config is not None else m.flavor
    return build_model_config(m.family, flavor, m.hf_config, ops_impl=m.ops_impl)
