"""The DPO configuration: SFT's sections (themselves pretraining's) plus a `dpo` section.

`model`, `data`, `parallel`, `optim`, `train`, `checkpoint`, `logging` and `profile` are the
classes `SFTConfig` uses, with the same spellings; `data.paths` hold preference records
(`mindspeed_align.pairs`) and `train.micro_batch`/`global_batch` count pairs. Defaults are the
embedded demo (`mindspeed dpo` with no arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mindspeed_align.losses import DPO_LOSSES
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_llm.train.config import LoggingSection, TrainSection
from mindspeed_llm.train.sft_config import SFTConfig

__all__ = ["DPOConfig", "DPOSection", "ORPOConfig", "REFERENCE_FREE", "SimPOConfig"]

REFERENCE_FREE = ("simpo", "orpo")
"""Losses that read no reference model."""


@dataclass(kw_only=True)
class DPOSection:
    loss: Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"] = "sigmoid"
    """The preference loss (`mindspeed_align.losses`): DPO's sigmoid (cDPO with
    label_smoothing), hinge, ipo, robust; or the reference-free simpo and orpo."""
    beta: float = 0.1
    """β: the inverse temperature of the implicit reward (ORPO: the weight λ of its odds-ratio
    term)."""
    label_smoothing: float = 0.0
    """ε: the assumed fraction of flipped labels (sigmoid: cDPO; robust; simpo)."""
    ref: Literal["auto", "model", "precompute", "none"] = "auto"
    """The reference: a frozen copy of the starting model under the run's layout (`model`);
    `precompute`: that copy scores every pair once before step 1 (cached in the data cache
    folder, keyed by the pairs and its weights) and is then dropped; none (`none`, only for
    simpo and orpo); or `auto`: none for simpo/orpo, else with LoRA the base itself (the
    policy with its adapters bypassed: no second copy), else `model`; and precomputed (by
    that base or copy) when `train.steps x train.global_batch` reads every training pair at
    least once (then one pass costs no more forwards than scoring each step's pairs, and the
    copy is freed before step 1)."""
    pref_ftx: float = 0.0
    """Weight of the NLL of the chosen reply (per-token mean, per pair) added to each pair's loss
    (MindSpeed-LLM's name; ORPO always adds it with weight 1 + pref_ftx)."""
    simpo_gamma: float = 0.5
    """SimPO's target margin γ (TRL's `simpo_gamma`; MindSpeed-LLM's gamma_beta_ratio is γ/β)."""
    shared_prompts: Literal["auto", "on", "off"] = "auto"
    """Each pair's prompt once in its packed row, the chosen and rejected replies attending to
    it (`logps.pack_pairs(share_prompts=True)`), so the prompt's forward and backward run once
    per pair; the log-probs are the separate sequences'. `auto`: on where it can run (no
    pipeline or context parallel; a family of softmax attention layers, not latent or linear
    attention, and no MTP), else off; `on`: refused where it cannot."""

    def __post_init__(self):
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta={self.beta} must be positive")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.ref == "none" and self.loss in DPO_LOSSES:
            raise ConfigError(f"dpo.ref=none: dpo.loss={self.loss} needs a reference model "
                              f"(ref: model), or pick a reference-free loss {REFERENCE_FREE}")  # fmt: skip
        if self.pref_ftx < 0:
            raise ConfigError(f"dpo.pref_ftx={self.pref_ftx} must be >= 0")
        if self.shared_prompts not in ("auto", "on", "off"):
            raise ConfigError(f"dpo.shared_prompts={self.shared_prompts!r} is not auto, on or off")

    @property
    def uses_reference(self) -> bool:
        return self.ref in ("model", "precompute") or (
            self.ref == "auto" and self.loss not in REFERENCE_FREE
        )


def _dpo_train() -> TrainSection:
    return TrainSection(steps=200, micro_batch=8, global_batch=16, eval_interval=0)


@dataclass(kw_only=True)
class DPOConfig(SFTConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=10))
    train: TrainSection = field(default_factory=_dpo_train)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir=Path("runs/dpo")))
    dpo: DPOSection = field(default_factory=DPOSection)
    """The preference method (loss, β, reference)."""

    def __post_init__(self):
        super().__post_init__()
        split = [f"parallel.{d}={getattr(self.parallel, d)}" for d in ("pp", "cp") if getattr(self.parallel, d) > 1]
        if split and self.dpo.ref == "model":
            raise ConfigError(f"dpo.ref=model with {' and '.join(split)}: there the reference log-probs are "
                              "precomputed (dpo.ref: precompute or auto)")  # fmt: skip

@dataclass(kw_only=True)
class SimPOConfig(DPOConfig):
    """`mindspeed simpo`: DPO's sections with SimPO's defaults (β 2.0, γ 1.0: the SimPO
    paper's Llama/Mistral-base range, γ/β = 0.5), no reference model."""

    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir=Path("runs/simpo")))
    dpo: DPOSection = field(default_factory=lambda: DPOSection(loss="simpo", beta=2.0, simpo_gamma=1.0))
    """The method (`dpo.loss` simpo; the section keeps its `mindspeed dpo` name)."""


@dataclass(kw_only=True)
class ORPOConfig(DPOConfig):
    """`mindspeed orpo`: DPO's sections with ORPO's defaults (λ = dpo.beta 0.1, TRL's), no
    reference model; the chosen reply's NLL is always part of the loss."""

    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir=Path("runs/orpo")))
    dpo: DPOSection = field(default_factory=lambda: DPOSection(loss="orpo", beta=0.1))
    """The method (`dpo.loss` orpo; the section keeps its `mindspeed dpo` name)."""
