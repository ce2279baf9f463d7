"""The pretraining configuration: one small dataclass per section.

Defaults are the embedded demo: the `debug` Llama on the corpus MindSpeed
generates itself (see `mindspeed_llm.demo`), on CPU, in a few minutes. Every field
can be set in YAML or with `--section.field value`.

The `parallel`, `optim` and `checkpoint` sections are mindspeed-core's (next to the
components they configure); `model`, `train` and `logging` are shared by every trainer
of this package; `data` is pretraining's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mindspeed_core.checkpoint import CheckpointConfig
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.profiling import ProfileConfig

# The sections' earlier names (they moved to mindspeed-core).
ParallelSection = ParallelConfig
OptimSection = OptimConfig
CheckpointSection = CheckpointConfig


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
    vocab_divisible_by: int = 128
    """Under parallel.tp > 1 the embedding and output are padded to a multiple of
    vocab_divisible_by x tp rows (Megatron's --make-vocab-size-divisible-by); the padding
    is never predicted and never saved."""
    router_aux_loss_scope: Literal["model", "layer"] = "model"
    """MoE: the load-balancing loss pooled over all layers (Hugging Face's) or each
    layer's own, averaged (Megatron's); pipeline parallel needs "layer"."""


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
class TrainSection:
    steps: int = 300
    """Optimizer steps."""
    micro_batch: int = 8
    """Samples per forward/backward on each data-parallel rank."""
    global_batch: int = 16
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_tokens: int | None = None
    """A token budget per micro-batch instead of `micro_batch` rows (SFT, the DPO family,
    RM, PRM): each step's `global_batch` samples (SFT's rows under `data.mode: pack`) are
    shared out to the data-parallel ranks by token count (longest first onto the lightest
    rank), then packed whole, each micro-batch one row of at most this many tokens
    (documents kept apart by `cu_seqlens`); every rank runs as many micro-batches. GRPO/PPO
    updates pack each rank's own rollouts the same way. The loss is normalised as without
    it. Not with pipeline parallel, pretraining or KTO. None: `micro_batch` rows."""
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype; master weights and gradient reduction stay fp32."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation recompute per block."""
    compile: Literal["auto", "on", "off"] | bool = "auto"
    """torch.compile each transformer block as one graph (after tensor parallel and recompute,
    before FSDP; parameter names unchanged). auto: on for CUDA and NPU, off on CPU (where
    compiling takes longer than most CPU runs); on / off (or true / false). A model whose
    blocks cannot compile as one graph (gated DeltaNet's delta rule, MoE with a capacity
    limit) says so in one log line and runs eager. The first steps pay the compilation."""
    cuda_graphs: bool = False
    """Replay each compiled block as CUDA graphs (torch.compile's "reduce-overhead"): the host
    launches a block's kernels in one call. Needs a CUDA device and `compile` auto or on, and
    fixed shapes: a graph is recorded per micro-batch shape and per count of packed documents
    (the attention then sizes its kernel for the row's length, the bound of any document).
    Not measured yet."""
    fp8: bool = False
    """fp8 linear layers (torchao's float8 training: e4m3 inputs and weights, e5m2 output
    gradients, one dynamic scale per tensor) for every linear but the output head whose
    features are multiples of 16; needs torchao (`pip install 'mindspeed-core[fp8]'`) and
    an fp8 GEMM (H100-class GPUs, recent PyTorch on CPU); not with tensor parallel."""
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
    loss_normalization: Literal["token", "sample"] = "token"
    """token: the step's loss is the mean over all its supervised tokens (every layout and
    accumulation gives the same); sample: the mean over each sequence first, then over
    the sequences (MindSpeed-LLM's weighting)."""
    fused_linear_cross_entropy: Literal["auto", "on", "off"] = "auto"
    """The next-token loss (pretrain, sft) and the DPO family's log-probs through the fused
    linear + cross-entropy op: the output projection and the loss run chunk by chunk, so
    no (tokens x vocab) logits are held (at vocab 128k and 8k tokens: 4 GiB in fp32, again
    for their gradient), for about a third more output-layer FLOPs (the backward
    recomputes each chunk's logits). auto: on for micro-batches whose fp32 logits would
    take 1 GiB or more, where the layout allows (no pipeline or tensor parallel, a plain
    output layer), and always for a frozen reference's forwards (no backward: no cost);
    on: always (an error where it cannot run); off: never."""

    def __post_init__(self):
        for name in ("steps", "micro_batch", "global_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be positive")
        budget = self.micro_batch_tokens
        if budget is not None and budget < 1:
            raise ConfigError(f"train.micro_batch_tokens={budget} must be positive")
        if self.exit_at_step is not None and self.exit_at_step < 1:
            raise ConfigError(f"train.exit_at_step={self.exit_at_step} must be positive")
        if self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches={self.eval_batches} must be >= 0")
        if isinstance(self.compile, bool):
            self.compile = "on" if self.compile else "off"
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"train.compile={self.compile!r} must be auto, on or off")


@dataclass(kw_only=True)
class LoggingSection:
    run_dir: Path = Path("runs/pretrain")
    """Where config.yaml, metrics.jsonl, tb/, checkpoints/ and loss_curve.png go."""
    log_interval: int = 10
    tensorboard: bool = True
    progress: bool = True
    """A progress bar with loss, tokens/s, MFU and ETA on rank 0."""
    wandb: bool = False
    """Also log the scalars to Weights & Biases (`pip install 'mindspeed-core[wandb]'`)."""
    wandb_project: str = "mindspeed"
    wandb_name: str | None = None
    """The W&B run's name (default: the run directory's name)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: files in run_dir/wandb only (`wandb sync` uploads them); online: streamed."""
    hf_export_every: int = 0
    """Every N steps (a multiple of checkpoint.interval) also write that step's checkpoint as a
    Hugging Face folder, run_dir/hf/step_N (`mindspeed convert --to hf`; LoRA runs merged);
    0: never."""

    def wandb_options(self):
        """The `WandbOptions` of this section (None when logging.wandb is off)."""
        from mindspeed_core.training import WandbOptions

        if not self.wandb:
            return None
        return WandbOptions(project=self.wandb_project, name=self.wandb_name, mode=self.wandb_mode)


@dataclass(kw_only=True)
class PretrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingSection = field(default_factory=LoggingSection)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self):
        if self.optim.warmup_steps > self.train.steps:
            raise ConfigError(
                f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
            )
