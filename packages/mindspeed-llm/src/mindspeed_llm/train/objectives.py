"""Objectives: what a trainer optimises, apart from how a step runs.

The step (`train.step`) makes the loss of an optimizer step

    loss = sum over the step's supervised units of their loss / number of those units

over every micro-batch and every data-parallel and context-parallel rank, so it is the
same in every layout and under any gradient accumulation. An objective says what a
unit is and what it costs, in three parts that also fit a pipeline, whose last stage
sees only the model's outputs and that stage's targets:

- `num_units(batch)`: the units a micro-batch supervises, from the batch alone, before
  any forward (tokens with a label; sequences; preference pairs);
- `targets(batch)`: what the loss reads besides the outputs, a dict of tensors; one
  shaped like `input_ids` is per token and is sharded with the inputs under context
  parallel (labels, per-token weights or advantages);
- `loss(outputs, targets, ctx)`: the SUM of the units' losses in this micro-batch, with
  optional metric sums (reported divided by the step's units too).

The model's own auxiliary losses (MoE routers) are added by the step, for every
objective. `NextToken` is pretraining's and SFT's (masking through labels = -100).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

import mindspeed_ops
from mindspeed_core.parallel.dtensor import full
from mindspeed_llm.data.collate import IGNORE_INDEX, Batch

if TYPE_CHECKING:
    from mindspeed_core.parallel import ParallelDims
    from mindspeed_llm.models import TransformerConfig
    from mindspeed_llm.train.build import BuiltModel, TrainParts
    from mindspeed_llm.train.start import StartingWeights

__all__ = ["LossContext", "LossOutput", "NextToken", "Objective", "RunContext", "segment_ids",
           "token_nll"]  # fmt: skip


@dataclass(frozen=True)
class RunContext:
    """What a method may use when its trainer is built: handed to `Objective.setup`, where
    the method creates its extra roles (a frozen reference, a process group) and keeps them
    on itself; the trainer never has them assigned into it from outside."""

    cfg: Any
    dims: ParallelDims
    model_config: TransformerConfig
    device: torch.device
    data: Any
    """The run's data source (e.g. `SFTData`: its tokenizer, `pad_id`)."""
    policy: BuiltModel
    """The model being trained."""
    build_model: Callable[..., BuiltModel]
    """Another model of this run (`Trainer.build_model`): the policy's config, layout,
    precision and seed; `starting_policy` adds the warm start (use it for a reference)."""
    add_states: Callable[[dict[str, Any]], None]
    """More `Stateful`s for the run's checkpoints (`Trainer.add_states`)."""
    parts: TrainParts | None = None
    """The policy's model, optimizer and schedule (`build.build_train_parts`)."""
    accum: int = 1
    """Micro-batches per step on each data-parallel rank."""
    step_options: dict[str, Any] = field(default_factory=dict)
    """`TrainStep`'s keyword options for this run (clip_grad, n_microbatches, ...)."""
    start: StartingWeights | None = None
    """The warm start the policy was given (`Trainer(init_state=..., init_from=...)`), if
    any; `starting_policy` gives it to every model built as the policy started."""

    def starting_policy(
        self, *, frozen: bool = True, whole: bool = False, head: bool = True, **options: Any
    ) -> Any:
        """The policy as this run started it, built again: the run's model config, layout,
        precision, seed or Hugging Face weights, then its warm start. For a reference, a KL
        anchor (`frozen`, the default) or a critic's trunk (`frozen=False, head=False,
        before_tp=add_score_head`: a new output layer kept). `options` are
        `build.build_model`'s (`after_tp=` adapters, `parallel=` ...). A `BuiltModel`;
        with `whole`, one plain module holding the whole model in this process (in eval
        mode when frozen), whatever the layout (a pipeline run precomputes a reference
        with it). The trainer's `after_tp` hook is not applied: under LoRA this is the
        base without adapters, a second copy of it; the policy called inside
        `mindspeed_llm.peft.adapters_disabled` gives the same outputs with no copy (what
        LoRA-DPO and LoRA RL use).

        Raises:
            ConfigError: a frozen copy under pipeline parallel (it runs inside each
                training step, and a pipeline stage holds only its own layers).
        """
        from mindspeed_core.errors import ConfigError
        from mindspeed_llm.train.start import starting_model

        if whole:
            from mindspeed_llm.models.startup import build_whole

            cfg = self.cfg
            model = build_whole(self.model_config, self.device, seed=cfg.train.seed,
                                hf_path=cfg.model.hf_path)  # fmt: skip
            if self.start is not None:
                self.start.give(model, head=head)
            return model.requires_grad_(False).eval() if frozen else model
        if frozen and self.dims.pp > 1:
            raise ConfigError(
                f"parallel.pp={self.dims.pp}: a frozen copy of the starting policy runs inside "
                "each training step, and a pipeline stage holds only its own layers; train "
                "with parallel.pp=1 (tp, cp, ep and FSDP hold it), or precompute what the "
                "copy scores (`mindspeed dpo` does under pp)"
            )
        return starting_model(self.build_model, self.start, frozen=frozen, head=head, **options)


@dataclass(frozen=True)
class LossContext:
    """How the outputs were computed; what a loss needs to read them."""

    loss_parallel: bool = False
    """The logits are vocabulary-sharded DTensors (tp > 1 with loss parallel)."""
    ops_impl: str = "auto"
    """The mindspeed_ops backend of the model."""
    token_nll: bool = False
    """The outputs are not logits but each position's -log p(label), (tokens,) fp32 (0
    where the label is -100), from the fused linear + cross-entropy op (see
    `Objective.reads_token_nll_only`); `token_nll` passes them through."""


@dataclass
class LossOutput:
    loss_sum: Tensor
    """Scalar: the sum of this micro-batch's unit losses (differentiable)."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Sums over the same units of values to report (no gradient), e.g. correct pairs."""


class Objective(ABC):
    """A training objective; see the module docstring for the contract."""

    metric_names: tuple[str, ...] = ()
    """The keys of `LossOutput.metrics` (every rank reduces them, in this order)."""

    supervised_logits_only: bool = False
    """The loss reads the outputs only where the label is not -100, and every target is
    per position: the step then projects those positions only (`Transformer.forward(keep=
    ...)`) and `loss` gets (supervised positions, vocab) logits and targets cut to the same
    positions. Used without tensor, context or pipeline parallelism (else every position)."""

    reads_token_nll_only: bool = False
    """The loss reads the outputs only through `token_nll` (each position's -log p of its
    label): the step may then have the model compute those with the fused linear +
    cross-entropy op (`train.fused_linear_cross_entropy`), so that no logits exist, and
    `loss` gets them as outputs with `LossContext.token_nll` set."""

    @abstractmethod
    def num_units(self, batch: Batch) -> Tensor:
        """Scalar count (int or float) of the units `batch` supervises."""

    @abstractmethod
    def targets(self, batch: Batch) -> dict[str, Tensor]:
        """What `loss` reads besides the outputs."""

    @abstractmethod
    def loss(self, outputs: Tensor, targets: dict[str, Tensor], ctx: LossContext) -> LossOutput:
        """The sum of the unit losses of one micro-batch (or its context-parallel share)."""

    def setup(self, run: RunContext) -> None:
        """Called once by `Trainer` when the policy is built, before any step: create what
        the method needs besides the policy (see `RunContext`). Default: nothing."""
        return None

    def build_step(self, run: RunContext) -> Any:
        """The run's optimizer step (a `train.step.TrainStep`), called once after `setup`: a
        method with its own step (RL's rollout, then train) builds and returns it. Default
        None: the trainer's `TrainStep(run.parts, objective, run.dims, **run.step_options)`."""
        return None

    def finish_metrics(self, metrics: dict[str, float], units: float) -> dict[str, float]:
        """The step's reported metrics from the reduced ones (each metric sum over every
        rank divided by the step's `units`); an objective whose metrics are means over a
        subset of its units (KTO's desirable examples) turns ratios of sums into them here."""
        return metrics


def token_nll(logits: Tensor, labels: Tensor, ctx: LossContext, reduction: str = "sum") -> Tensor:
    """Cross entropy of (..., vocab) logits against labels (-100 ignored): "sum", or
    "none" for (tokens,) fp32 values (0 where ignored). Loss-parallel logits go through
    torch's vocab-parallel kernel, others through `mindspeed_ops.cross_entropy`; outputs
    that already are the nll (`ctx.token_nll`) pass through."""
    if ctx.token_nll:
        return logits.sum() if reduction == "sum" else logits
    logits, labels = logits.flatten(0, -2), labels.flatten()
    if ctx.loss_parallel:
        nll = F.cross_entropy(logits.float(), labels, reduction=reduction)
        return full(nll) if reduction == "none" else nll
    return mindspeed_ops.cross_entropy(logits, labels, reduction=reduction, impl=ctx.ops_impl)


def segment_ids(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """(num_tokens,) index of the packed document each flattened token belongs to."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


class NextToken(Objective):
    """Next-token cross entropy; positions labelled -100 are not supervised.

    Args:
        normalization: "token": every supervised token weighs the same (the step's loss
            is the mean over its supervised tokens); "sample": the mean over each
            sequence (a packed document of `cu_seqlens`) first, then the mean over the
            sequences that have a supervised token, as MindSpeed-LLM weighs SFT data.
        supervised_logits_only: project only the labelled positions (SFT: the replies;
            pretraining reads nearly every position, so it keeps them all).
    """

    @property
    def reads_token_nll_only(self) -> bool:
        return type(self).loss is NextToken.loss  # a subclass's own loss may read logits

    def __init__(
        self, normalization: Literal["token", "sample"] = "token", *,
        supervised_logits_only: bool = False,
    ):
        if normalization not in ("token", "sample"):
            raise ValueError(f"normalization={normalization!r} is not 'token' or 'sample'")
        self.normalization = normalization
        self.supervised_logits_only = supervised_logits_only

    def num_units(self, batch: Batch) -> Tensor:
        supervised = batch["labels"] != IGNORE_INDEX
        if self.normalization == "token":
            return supervised.sum()
        docs = segment_ids(batch["cu_seqlens"], supervised.numel())
        per_doc = torch.zeros(len(batch["cu_seqlens"]) - 1, device=docs.device)
        return (per_doc.index_add_(0, docs, supervised.flatten().float()) > 0).sum()

    def targets(self, batch: Batch) -> dict[str, Tensor]:
        if self.normalization == "token":
            return {"labels": batch["labels"]}
        return {"labels": batch["labels"], "weights": _sample_weights(batch)}

    def loss(self, outputs: Tensor, targets: dict[str, Tensor], ctx: LossContext) -> LossOutput:
        if self.normalization == "token":
            return LossOutput(token_nll(outputs, targets["labels"], ctx))
        nll = token_nll(outputs, targets["labels"], ctx, reduction="none")
        return LossOutput((nll * targets["weights"].flatten()).sum())


def _sample_weights(batch: Batch) -> Tensor:
    """Per token: 1 / (supervised tokens of its document), 0 where unsupervised."""
    supervised = (batch["labels"] != IGNORE_INDEX).flatten().float()
    docs = segment_ids(batch["cu_seqlens"], supervised.numel())
    counts = torch.zeros(len(batch["cu_seqlens"]) - 1, device=docs.device)
    counts.index_add_(0, docs, supervised)
    return (supervised / counts[docs].clamp(min=1)).view_as(batch["labels"])
