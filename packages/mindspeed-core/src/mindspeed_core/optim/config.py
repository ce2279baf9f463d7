"""`OptimConfig`: the `optim` section of every training command, and what it builds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from mindspeed_core.optim.optimizer import (
    OptimizersContainer,
    build_optimizers,
    check_adamw_args,
)
from mindspeed_core.optim.scheduler import LRSchedulersContainer, build_lr_schedulers


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    warmup_steps: int = 20
    """Steps of linear warmup from lr / warmup_steps to lr."""
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """LR decay after warmup (wsd: warmup-stable-decay)."""
    decay_steps: int | None = None
    """WSD only: length of the final decay (default: everything after warmup)."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (vectors and scalars get none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernel: auto picks fused on CUDA, foreach elsewhere."""

    config_key: ClassVar[str] = "optim"
    """The section's key in its command's config, for error messages (a critic's is critic)."""

    def __post_init__(self):
        check_adamw_args(
            self.lr, tuple(self.betas), self.eps, self.weight_decay, section=self.config_key
        )

    def build(
        self, model_parts: nn.Module | Sequence[nn.Module], total_steps: int
    ) -> tuple[OptimizersContainer, LRSchedulersContainer]:
        """AdamW over the trainable parameters of `model_parts`, and its LR schedule over
        `total_steps` optimizer steps."""
        optimizer = build_optimizers(
            model_parts,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=tuple(self.betas),
            eps=self.eps,
            implementation=self.implementation,
        )
        scheduler = build_lr_schedulers(
            optimizer,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps,
            decay_style=self.decay_style,
            min_lr_ratio=self.min_lr_ratio,
            decay_steps=self.decay_steps,
        )
        return optimizer, scheduler
