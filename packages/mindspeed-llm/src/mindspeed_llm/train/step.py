"""One optimizer step of any objective: accumulation or the pipeline schedule, context-
parallel sharding, autocast and loss parallel, fp16 scaling, clipping, non-finite skip.

The loss of a step is the sum of its units' losses over the number of units in the
whole step. That count is taken from the batches before any forward: summed over this
rank's micro-batches, then over the data-parallel ranks (`dp` mesh; context-parallel and
tensor-parallel peers read the same batches). FSDP/DDP average gradients over the
`loss` mesh (dp x cp), so each rank backpropagates `loss_sum * |loss| / count`, and the
averaged gradient is that of the global mean, whatever the layout and accumulation.
Under context parallel each rank's `loss_sum` covers its share of the tokens (the count
is still the whole batch's, not the shard's numel).

A step reads no device value on the host (an accelerator would make the host wait for
every kernel queued before it): what depends on the batch's values is worked out on the
host batch, the batch moves without blocking (`collate.to_device`), counts and losses
stay device tensors (`StepResult` reads them when asked: the loop's logging steps), and a
non-finite loss or gradient norm skips the update on the device (fused AdamW). What still
reads: the fp16 loss scaler, a non-fused AdamW's skip, MoE's router statistics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from mindspeed_core.checkpoint import TrainState
from mindspeed_core.optim import clip_grad_norm_
from mindspeed_core.parallel import ParallelDims, build_pipeline_schedule, loss_parallel_context
from mindspeed_core.parallel.dtensor import full
from mindspeed_llm.data.collate import (
    IGNORE_INDEX,
    Batch,
    concat_batches,
    forward_packed,
    shard_context_parallel,
    split_batch,
    to_device,
)
from mindspeed_llm.models.common.moe_stats import moe_aux_loss
from mindspeed_llm.models.common.mtp import take_mtp_loss
from mindspeed_llm.models.common.parallelize import tied_embedding_grads
from mindspeed_llm.train.build import TrainParts
from mindspeed_llm.train.head import fused_ce_mode, fuses_tokens, supervised_positions_layout
from mindspeed_llm.train.objectives import LossOutput, Objective
from mindspeed_llm.train.result import NonfiniteSteps, StepResult, TrainingError
from mindspeed_ops.validate import carry_host_values, host_values, remember_host_values

__all__ = ["StepResult", "TrainStep", "TrainingError", "supervised_positions_layout"]


class TrainStep:
    """Steps `parts` on micro-batches with `objective`.

    Args:
        parts: the model, optimizer, schedule, scaler and counters (`build_train_parts`).
        objective: what to optimise.
        dims: the built layout.
        clip_grad: max global gradient norm (0: measure only).
        n_microbatches: pipeline microbatches per step (pp > 1).
        max_nonfinite_steps: inf/nan losses in a row that stop training.
        fused_linear_cross_entropy: "on": an objective that reads only each token's nll
            (`Objective.reads_token_nll_only`: pretraining's, SFT's, DPO's) gets it from the
            fused linear + cross-entropy op, no logits held; "auto": on where a
            micro-batch's fp32 logits would take `head.FUSED_CE_AUTO_BYTES` or more and the
            layout allows it (no pipeline or tensor parallel, a plain output layer);
            "off": logits, then cross entropy.
    """

    def __init__(
        self,
        parts: TrainParts,
        objective: Objective,
        dims: ParallelDims,
        *,
        clip_grad: float = 1.0,
        n_microbatches: int | None = None,
        max_nonfinite_steps: int = 5,
        fused_linear_cross_entropy: str = "auto",
    ):
        self.parts, self.model, self.objective, self.dims = parts, parts.model, objective, dims
        self.clip_grad = clip_grad
        self.max_nonfinite_steps = max_nonfinite_steps
        self.n_microbatches = n_microbatches
        self.schedule = None
        if self.model.pipeline is not None:
            if n_microbatches is None:
                raise ValueError("a pipelined model needs n_microbatches per step")
            self.schedule = build_pipeline_schedule(
                self.model.pipeline.stages,
                n_microbatches,
                self._pipeline_loss,
                self.model.pipeline_schedule,
                scale_grads=False,  # the loss is already normalised over the whole step
            )
        self._pp: dict = {}
        # MTP losses of the step's micro-batches (None: the model has no MTP modules)
        self._mtp = [] if self.model.config.num_nextn_predict_layers else None
        # tied embeddings under pp: the first and last stage's copies sum their gradients
        self._tied = tied_embedding_grads(self.model.parts, dims)
        # the blocks that attach a loss to their output (`_scale_attached_aux`)
        self._attaching = [m for part in self.model.parts for m in part.modules()
                           if hasattr(m, "aux_grad_scale")]  # fmt: skip
        # logits at the supervised positions only (see Objective.supervised_logits_only)
        self._supervised_only = bool(
            getattr(objective, "supervised_logits_only", False)
            and supervised_positions_layout(self.model, dims)
        )
        self._fused_ce = fused_ce_mode(fused_linear_cross_entropy, objective, self.model, dims)
        self._nll_context = replace(self.model.loss, token_nll=True)
        self._nonfinite = NonfiniteSteps(parts.state, max_nonfinite_steps)

    @property
    def state(self) -> TrainState:
        return self.parts.state

    def __call__(self, micro_batches: Sequence[Batch], *, schedule: bool = True) -> StepResult:
        """One optimizer step on this rank's micro-batches of the step; `schedule`: the
        LR schedule moves on too (false for all but the last of several updates that
        make one training step, e.g. RL's mini-batches)."""
        self.parts.optimizer.zero_grad()
        units, tokens = self._count(micro_batches)
        # degree / units, 0 without units: a device tensor, never read here
        weight = (self.dims.degree("loss") / units.clamp(min=1) * (units > 0)).float()
        if self.schedule is not None:
            loss_sum, sums = self._pipeline(micro_batches, weight, train=True)
        else:
            loss_sum, sums = self._forward_backward(micro_batches, weight)
        loss, metrics = self._reduce(loss_sum, sums, units)
        extra = {**self._router_step(), **self._mtp_step()}
        grad_norm = self._optimizer_step(loss, schedule)
        return StepResult(loss, grad_norm, units, tokens, metrics, extra=extra,
                          finish=self.objective.finish_metrics, on_read=self._nonfinite.settle)  # fmt: skip

    @torch.no_grad()
    def evaluate(self, steps: Sequence[Sequence[Batch]]) -> float:
        """The objective over the micro-batches of `steps` (forward only, every rank)."""
        units, loss_sum = 0.0, torch.zeros((), device=self.model.device)
        for micro_batches in steps:
            units = units + self._count(micro_batches)[0]
            if self.schedule is not None:
                loss_sum += self._pipeline(micro_batches, 0.0, train=False)[0]
            else:
                for batch in micro_batches:
                    with self._compute_context():
                        loss_sum += full(self._forward(batch).loss_sum)
        return float(self._reduce(loss_sum, {}, units)[0])

    # -- counting and reducing ------------------------------------------------------

    def _count(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """(supervised units, input tokens) of the step over every data-parallel rank, as
        float64 device tensors: counted on the host batches (reading them waits for
        nothing), summed over the ranks on the device, never read back here."""
        units = sum(float(self.objective.num_units(b)) for b in micro_batches)
        tokens = sum(b["input_ids"].numel() for b in micro_batches)
        counts = torch.tensor([units, tokens], dtype=torch.float64)
        counts = counts.to(self.model.device, non_blocking=True)
        mesh = self.dims.mesh("dp")
        if mesh is not None:
            dist.all_reduce(counts, group=mesh.get_group())
        return counts[0], counts[1]

    def _reduce(self, loss_sum, sums: dict, units) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sums of this rank's share -> values over every rank, divided by the units (nan
        without units), as device tensors."""
        values = torch.stack([loss_sum.detach().float(), *(full(v).float() for v in sums.values())])
        mesh = self.dims.mesh("loss")
        if mesh is not None:
            dist.all_reduce(values, group=mesh.get_group())
        values = torch.where(units > 0, values / units.clamp(min=1), math.nan)
        return values[0], dict(zip(sums, values[1:], strict=True))

    # -- forward and backward -------------------------------------------------------

    def _forward(self, batch: Batch, *, train: bool = False):
        """The objective's output on `batch` (this rank's context-parallel share); in
        training a model with MTP modules also gets the labels (see `_aux_loss`).

        What depends on the batch's values (the targets, the context-parallel shards, the
        supervised positions) is worked out on the host batch, where reading costs nothing;
        then batch and targets move to the device without waiting (`to_device`)."""
        device = self.model.device
        targets = self.objective.targets(batch)
        if self.dims.cp > 1:
            batch, targets = shard_context_parallel(
                batch, self.dims.rank("cp"), self.dims.cp, targets
            )
        extra, keep = {}, None
        if self._supervised_only:  # per-token targets follow the kept positions
            mask = batch["labels"] != IGNORE_INDEX
            targets = {k: v[mask] if v.shape == mask.shape else v for k, v in targets.items()}
            keep = mask.flatten().nonzero().squeeze(1)  # flat positions, not a mask: no sync
            extra["keep"] = keep.to(device, non_blocking=True)
        fuses = self._fuses(batch, keep)
        batch, targets = to_device(batch, device), to_device(targets, device)
        if train and self._mtp is not None:
            extra["mtp_labels"] = batch["labels"]
        ctx = self.model.loss
        if fuses:
            extra["nll_labels"], ctx = batch["labels"], self._nll_context
        outputs = forward_packed(self.model.model, batch, **extra)
        return self.objective.loss(outputs, targets, ctx)

    def _fuses(self, batch: Batch, keep) -> bool:
        """Whether the loss comes from the fused op (`keep`: the kept positions, host)."""
        tokens = batch["labels"].numel() if keep is None or self._fused_ce != "auto" else len(keep)
        return fuses_tokens(self._fused_ce, tokens, self.model.config.vocab_size)

    def _forward_backward(self, micro_batches, weight: float) -> tuple[torch.Tensor, dict]:
        """Gradient accumulation: each micro-batch backpropagates its share of the step."""
        loss_sum, sums = torch.zeros((), device=self.model.device), self._zero_metrics()
        scaler = self.parts.scaler
        self._scale_attached_aux(len(micro_batches))
        for batch in micro_batches:
            with self._compute_context():
                out = self._forward(batch, train=True)
                objective = out.loss_sum * weight
                aux = self._aux_loss()
                if aux is not None:  # the model's own loss, per micro-batch as before
                    # a replicated DTensor under loss parallel; aux is a plain tensor
                    objective = full(objective) + aux / len(micro_batches)
                (scaler.scale_loss(objective) if scaler else objective).backward()
            loss_sum += full(out.loss_sum).detach()
            _add(sums, out.metrics)
        return loss_sum, sums

    def _pipeline(self, micro_batches, weight: float, *, train: bool):
        """One schedule step (or forward-only pass) over the step's samples.

        Every pipeline rank reads the same batches: the first stage takes the tokens,
        every stage the positions and document boundaries (torch passes `kwarg_mbs` to
        each stage's forward), the last the targets. torch's schedules take one tensor
        per microbatch as target, so the target is the microbatch's index and the loss
        looks its targets up. The sums are the last stage's, summed over the pp group.
        """
        device = self.model.device
        batches = split_batch(concat_batches(list(micro_batches)), self.n_microbatches)
        targets = [to_device(self.objective.targets(b), device) for b in batches]  # host work
        batches = [to_device(b, device) for b in batches]
        args = [(b["input_ids"],) for b in batches]
        kwargs = [
            {"position_ids": b["position_ids"], "cu_seqlens": b["cu_seqlens"]} for b in batches
        ]
        if train and self._mtp is not None:  # the last stage attaches the MTP loss itself
            kwargs = [
                {**kw, "mtp_labels": b["labels"]} for kw, b in zip(kwargs, batches, strict=True)
            ]
        handles = []  # each microbatch's index, known on the host without a device read
        for i in range(len(batches)):
            host = remember_host_values(torch.tensor(i), i)
            handles.append(carry_host_values(host, host.to(device, non_blocking=True)))
        self._scale_attached_aux(len(batches))
        self._pp = {"targets": targets, "weight": weight, "outputs": {}, "mtp": {}}
        with self._compute_context():
            if train:  # the losses are all we need: do not keep every microbatch's logits
                self.schedule.step(arg_mbs=args, kwarg_mbs=kwargs, target_mbs=handles,
                                   return_outputs=False)  # fmt: skip
            else:
                self.schedule.eval(arg_mbs=args, kwarg_mbs=kwargs, target_mbs=handles, losses=[])
        outputs = [self._pp["outputs"][i] for i in sorted(self._pp["outputs"])]
        if self._pp["mtp"]:  # the last stage's microbatches' MTP losses, for the metric
            self._mtp += [self._pp["mtp"][i] for i in sorted(self._pp["mtp"])]
        loss_sum, sums = torch.zeros((), device=self.model.device), self._zero_metrics()
        for out in outputs:
            loss_sum += out.loss_sum
            _add(sums, out.metrics)
        reduced = torch.stack([loss_sum, *sums.values()])
        dist.all_reduce(reduced, group=self.dims.mesh("pp").get_group())
        return reduced[0], dict(zip(sums, reduced[1:], strict=True))

    def _scale_attached_aux(self, n_microbatches: int) -> None:
        """Losses that blocks attach to their outputs (`AttachAux`: MoE's aux loss under
        pipeline parallel, DeepSeek sparse attention's indexer loss always): each
        micro-batch's is its share of the step, as `_forward_backward` adds the model's
        other losses, times the fp16 loss scale (the objective's backward carries it)."""
        scale = 1.0 / n_microbatches
        if self.parts.scaler is not None:
            scale *= self.parts.scaler.scale
        for module in self._attaching:
            module.aux_grad_scale = scale

    def _pipeline_loss(self, outputs: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: this microbatch's share of the step (scaled for fp16).

        torch also calls it once on the first microbatch to infer gradient shapes; the
        real call comes later and replaces what that one recorded.
        """
        index = host_values(handle)  # remembered when the handle was made: no device read
        out = self.objective.loss(outputs, self._pp["targets"][index], self.model.loss)
        detached = {k: full(v).detach().float() for k, v in out.metrics.items()}
        self._pp["outputs"][index] = LossOutput(full(out.loss_sum).detach().float(), detached)
        for part in self.model.parts if self._mtp is not None else ():
            mtp = take_mtp_loss(part)  # attached to the output already: only noted
            if mtp is not None:
                self._pp["mtp"][index] = mtp.detach().float()
        loss = out.loss_sum * self._pp["weight"]
        return self.parts.scaler.scale_loss(loss) if self.parts.scaler else loss

    # -- the optimizer step ---------------------------------------------------------

    def _optimizer_step(self, loss: torch.Tensor, schedule: bool = True) -> torch.Tensor:
        """Unscale, clip, step and schedule (unless not `schedule`); the gradient norm, nan
        for a step skipped because its loss or gradient norm is not finite (or fp16
        gradients overflowed). The skip happens on the device where the optimizer can
        (torch's fused AdamW, `found_inf`), so nothing is read on the host; it is noted and
        `NonfiniteSteps.settle` counts it when a result is read."""
        parts = self.parts
        params = list(parts.optimizer.parameters())
        if parts.scaler is not None:  # fp16: the scaler reads its overflow flag on the host
            if not math.isfinite(float(loss)):
                self._nonfinite.note(
                    self.state.step + 1, loss, torch.ones((), dtype=torch.bool, device=loss.device)
                )
                return torch.full((), math.nan)
            found_inf = parts.scaler.unscale_(params)
            parts.scaler.update(found_inf)
            if found_inf:  # the fp16 gradients overflowed: skip, the scale went down
                parts.optimizer.zero_grad()
                if schedule:
                    parts.scheduler.step()
                return torch.full((), math.nan)
        if self._tied is not None:
            self._tied()
        exclude = self._tied.exclude if self._tied is not None else ()
        grad_norm = clip_grad_norm_(
            params, self.clip_grad, pp_mesh=self.dims.mesh("pp"), exclude=exclude
        )
        found = ~(torch.isfinite(loss) & torch.isfinite(full(grad_norm)))
        parts.optimizer.step(skip_if=found)
        if schedule:
            parts.scheduler.step()
        self._nonfinite.note(self.state.step + 1, loss, found)
        return torch.where(found, math.nan, full(grad_norm))

    # -- the model's side -----------------------------------------------------------

    def _aux_loss(self) -> torch.Tensor | None:
        """The model's own losses of the forward just run (added to the loss, not
        reported in it): MoE router losses, after noting the expert loads; the MTP loss
        (DeepSeek-V3), noted for its metric."""
        aux = None
        if self.model.router is not None:
            aux = moe_aux_loss(self.model.model, self.model.config)
            self.model.router.observe(aux)
        mtp = take_mtp_loss(self.model.model) if self._mtp is not None else None
        if mtp is not None:
            self._mtp.append(mtp.detach().float())
            aux = mtp if aux is None else aux + mtp
        return aux

    def _mtp_step(self) -> dict:
        """MTP: the mean weighted MTP loss of the step's micro-batches over the loss ranks
        (under pp the last stage's, shared over the pipeline ranks)."""
        if self._mtp is None or (not self._mtp and self.schedule is None):
            return {}
        device = self.model.device
        value = torch.stack(self._mtp).mean() if self._mtp else torch.zeros((), device=device)
        self._mtp.clear()
        if self.schedule is not None:  # one rank of each pipeline holds the last stage
            dist.all_reduce(value, group=self.dims.mesh("pp").get_group())
        mesh = self.dims.mesh("loss")
        if mesh is not None:
            dist.all_reduce(value, group=mesh.get_group())
            value = value / mesh.size()
        return {"mtp_loss": float(value)}

    def _router_step(self) -> dict:
        """MoE: expert-load metrics of the step over every data rank; updates the
        aux-loss-free router biases."""
        if self.model.router is None:
            return {}
        mesh = self.dims.mesh("loss")
        return self.model.router.step(None if mesh is None else mesh.get_group())

    def _zero_metrics(self) -> dict[str, torch.Tensor]:
        """Every rank reduces the same keys in the same order, whatever it computed."""
        return {k: torch.zeros((), device=self.model.device) for k in self.objective.metric_names}

    def _compute_context(self):
        stack = contextlib.ExitStack()
        if self.model.autocast is not None:
            stack.enter_context(torch.autocast(self.model.device.type, dtype=self.model.autocast))
        stack.enter_context(loss_parallel_context(self.model.loss.loss_parallel))
        return stack


def _add(sums: dict, metrics: dict) -> None:
    for key, value in metrics.items():
        if key not in sums:
            raise ValueError(f"metric {key!r} is not in the objective's metric_names {list(sums)}")
        sums[key] = sums[key] + full(value).detach().float()
