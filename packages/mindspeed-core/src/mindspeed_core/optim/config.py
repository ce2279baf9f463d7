"""`OptimConfig`: the `optim` section of every training command, and what it builds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch.distributed as dist
from torch import nn

from mindspeed_core.optim.adamw import STATE_DTYPES
from mindspeed_core.optim.muon import check_muon_args
from mindspeed_core.optim.optimizer import (
    OPTIMIZERS,
    OptimizersContainer,
    build_optimizers,
    check_adamw_args,
    check_choice,
)
from mindspeed_core.optim.scheduler import LRSchedulersContainer, build_lr_schedulers


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (Newton-Schulz-orthogonalised momentum, torch.optim.Muon's update)
    on the decoder blocks' matrices, AdamW on the embeddings, output head, norms, biases and
    routers; both take lr, its schedule and weight_decay."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of AdamW's two moments: bf16 halves their memory (updated in fp32, stored rounded)."""
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
    """AdamW kernel (fp32 moments): auto picks fused on CUDA, foreach elsewhere."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    muon_ns_steps: int = 5
    """Muon's Newton-Schulz iterations."""
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """dtype of Muon's Newton-Schulz iteration: bf16 (torch.optim.Muon's, fast) or fp32 (2x the
    matmul cost; layouts then agree to fp32's rounding: bf16 shows last-bit gradient
    differences, e.g. of another reduction order, amplified in the update)."""
    muon_adjust_lr: Literal["match_rms_adamw", "original", "spectral_unclamped"] = "match_rms_adamw"
    """How Muon scales lr per matrix shape: match_rms_adamw (Moonshot: 0.2 sqrt(max(rows,
    cols)), so AdamW's lr and weight decay carry over), original (Keller Jordan's), or
    spectral_unclamped (torch.optim.Muon's names)."""

    config_key: ClassVar[str] = "optim"
    """The section's key in its command's config, for error messages (a critic's is critic)."""

    def __post_init__(self):
        check_adamw_args(
            self.lr, tuple(self.betas), self.eps, self.weight_decay, section=self.config_key
        )
        check_muon_args(self.muon_momentum, self.muon_ns_steps, section=self.config_key)
        check_choice("name", self.name, OPTIMIZERS, self.config_key)
        check_choice("state_dtype", self.state_dtype, tuple(STATE_DTYPES), self.config_key)

    def build(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        total_steps: int,
        *,
        pp_group: dist.ProcessGroup | None = None,
    ) -> tuple[OptimizersContainer, LRSchedulersContainer]:
        """The optimizers over the trainable parameters of `model_parts` (AdamW, or Muon and
        AdamW), and their LR schedule over `total_steps` optimizer steps; `pp_group`: the
        pipeline group when `model_parts` are this rank's stages."""
        optimizer = build_optimizers(
            model_parts,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=tuple(self.betas),
            eps=self.eps,
            implementation=self.implementation,
            name=self.name,
            state_dtype=self.state_dtype,
            muon={
                "momentum": self.muon_momentum,
                "ns_steps": self.muon_ns_steps,
                "adjust_lr_fn": self.muon_adjust_lr,
                "ns_dtype": self.muon_ns_dtype,
            },
            pp_group=pp_group,
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
