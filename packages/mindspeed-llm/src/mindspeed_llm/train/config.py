"""The pretraining configuration: one small dataclass per section.

Defaults are the embedded demo: the `debug` Llama on the corpus MindSpeed
generates itself (see `mindspeed_llm.demo`), on CPU, in a few minutes. Every field
can be set in YAML or with `--section.field value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mindspeed_core.errors import ConfigError


@dataclass(kw_only=True)
class ModelSection:
    family: str = "llama"
    """Model family in the registry: llama, qwen2, qwen3, mistral, mixtral, qwen2_moe,
    qwen3_moe."""
    flavor: str | None = "debug"
    """A named size of the family (`debug` fits a CPU); ignored when `hf_config` is set."""
    hf_config: Path | None = None
    """A Hugging Face config.json (or its folder) to take the architecture from."""
    hf_path: Path | None = None
    """A Hugging Face model folder (config.json + safetensors) to start from: the
    architecture comes from its config.json (family, flavor and hf_config are ignored) and
    its weights are loaded before the model is parallelised; with data.paths it is also
    the tokenizer when data.tokenizer is unset (the embedded demo corpus keeps its own)."""
    ops_impl: str = "auto"
    """Fused-op backend: auto, reference, cpu, cuda or npu."""


@dataclass(kw_only=True)
class DataSection:
    paths: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes, optionally with weights: [0.3, a_text_document, 0.7, b...].
    Empty: the embedded demo corpus (generated and cached on first use)."""
    tokenizer: Path | None = None
    """A sentencepiece .model, a tokenizer.json or a folder holding one (demo: its own)."""
    split: str = "969,30,1"
    """Train/valid/test weights over each dataset's documents."""
    seq_len: int = 128
    """Tokens per sample."""
    reset_position_ids: bool = True
    """Restart positions after every end-of-document token."""
    reset_attention_mask: bool = True
    """Keep attention inside each packed document."""
    cache_dir: Path | None = None
    """Where sample indices are cached (default: next to the data)."""

    def __post_init__(self):
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len={self.seq_len} must be positive")


@dataclass(kw_only=True)
class ParallelSection:
    tp: int = 1
    """Tensor parallel degree."""
    pp: int = 1
    """Pipeline parallel degree: the model's layers split over this many ranks."""
    pp_schedule: Literal[
        "1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """torch.distributed.pipelining schedule; Interleaved* take virtual_stages >= 2,
    ZBVZeroBubble and DualPipeV exactly 2."""
    virtual_stages: int = 1
    """Pipeline stages per rank (pp x virtual_stages stages in all)."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Layers of each of the pp x virtual_stages stages, e.g. [3, 1]; empty: an even split
    (when it does not divide, the first stages take one layer more)."""
    pp_microbatches: int | None = None
    """Microbatches per pipeline step; default: the gradient-accumulation steps (one
    train.micro_batch each). It must divide the samples a rank takes per step."""
    cp: int = 1
    """Context parallel degree: every sequence split over this many ranks (zig-zag, so
    data.seq_len must be a multiple of 2 x cp)."""
    cp_mode: Literal["ring", "ulysses", "hybrid"] = "ring"
    """Context parallel attention: ring (K/V passed round), ulysses (all-to-all over heads)
    or hybrid (ulysses_degree ranks of Ulysses inside each ring step)."""
    ulysses_degree: int | None = None
    """cp_mode=hybrid: Ulysses ranks per ring step; must divide cp."""
    ep: int = 1
    """Expert parallel degree (MoE models): experts spread over this many of the
    dp_shard x cp ranks; must divide both that product and the model's num_experts."""
    dp_shard: int = -1
    """FSDP degree; -1 takes the processes the other degrees leave."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP when dp_shard > 1)."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence when tp > 1."""
    loss_parallel: bool = True
    """Keep logits vocab-sharded for the loss when tp > 1."""

    def __post_init__(self):
        hybrid_ok = isinstance(self.ulysses_degree, int) and self.ulysses_degree >= 1
        if self.cp_mode == "hybrid" and not (hybrid_ok and self.cp % self.ulysses_degree == 0):
            raise ConfigError(
                f"parallel.cp_mode=hybrid needs parallel.ulysses_degree dividing "
                f"parallel.cp={self.cp}, got {self.ulysses_degree}"
            )
        if self.virtual_stages < 1:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages} must be >= 1")
        if self.pp_microbatches is not None and self.pp_microbatches < 1:
            raise ConfigError(f"parallel.pp_microbatches={self.pp_microbatches} must be >= 1")


@dataclass(kw_only=True)
class OptimSection:
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    warmup_steps: int = 20
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    decay_steps: int | None = None
    """WSD only: length of the final decay (default: everything after warmup)."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 300
    """Optimizer steps."""
    micro_batch: int = 8
    """Samples per forward/backward on each data-parallel rank."""
    global_batch: int = 16
    """Samples per optimizer step over all data-parallel ranks."""
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype; master weights and gradient reduction stay fp32."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation recompute per block."""
    eval_interval: int = 100
    """Validation loss every N steps (0: never)."""
    eval_batches: int = 2
    """Global batches per validation (the same samples every time, in every layout)."""
    max_nonfinite_steps: int = 5
    """Stop after this many consecutive steps with an inf/nan loss (each is skipped)."""
    device: str = "auto"
    """auto, cpu, cuda or npu."""
    exit_at_step: int | None = None
    """Stop after this step with a checkpoint, as if preempted (the schedule still spans
    `steps`); run again to continue."""

    def __post_init__(self):
        for name in ("steps", "micro_batch", "global_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be positive")
        if self.exit_at_step is not None and self.exit_at_step < 1:
            raise ConfigError(f"train.exit_at_step={self.exit_at_step} must be positive")


@dataclass(kw_only=True)
class CheckpointSection:
    dir: Path | None = None
    """Checkpoint folder (default: <run_dir>/checkpoints)."""
    interval: int = 100
    """Save every N steps and at the end (0: only at the end)."""
    keep_last: int = 2
    load: Literal["auto", "none"] | Path = "auto"
    """auto: resume from `dir` when it holds a checkpoint; none; or a checkpoint folder."""
    async_save: bool = False


@dataclass(kw_only=True)
class LoggingSection:
    run_dir: Path = Path("runs/pretrain")
    """Where config.yaml, metrics.jsonl, tb/, checkpoints/ and loss_curve.png go."""
    log_interval: int = 10
    tensorboard: bool = True
    progress: bool = True
    """A progress bar with loss, tokens/s, MFU and ETA on rank 0."""


@dataclass(kw_only=True)
class PretrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self):
        if self.optim.warmup_steps > self.train.steps:
            raise ConfigError(
                f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
            )
