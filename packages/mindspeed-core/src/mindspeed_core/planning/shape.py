"""What the planner knows about a model, a parallel layout and a training job: plain data.

`ModelShape` is model-agnostic (a pre-norm decoder with GQA attention and a SwiGLU MLP,
optionally MoE); mindspeed-llm builds one from its `TransformerConfig`
(`mindspeed_llm.models.shape.model_shape`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed_core.errors import ConfigError

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
AC_MODES = ("none", "selective", "full")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes of a decoder-only transformer."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Width of each of the two SwiGLU input projections of a dense MLP."""
    vocab_size: int
    max_position_embeddings: int = 4096
    """Rows of the fp32 RoPE tables every rank keeps."""
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    """Routed experts per MoE layer; 0: dense."""
    num_moe_layers: int = 0
    """How many of the layers are MoE (the others dense)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    name: str = "model"

    def attention_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return self.hidden_size * (2 * q + 2 * kv) + bias + norms

    def mlp_params(self, moe: bool) -> int:
        """One layer's MLP: dense SwiGLU, or all experts + router + shared expert."""
        h = self.hidden_size
        if not moe:
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size
        shared += h if self.shared_expert_intermediate_size else 0  # its sigmoid gate
        return self.num_experts * (3 * h * self.moe_intermediate_size + h) + shared

    def routed_expert_params(self) -> int:
        """One MoE layer's routed experts (the stacked w1/w3/w2: what expert parallel
        spreads and tensor parallel leaves whole)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self, moe: bool = False) -> int:
        return self.attention_params() + self.mlp_params(moe) + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def largest_tensor(self) -> int:
        """Elements of the largest tensor a rank draws or reads whole while the model
        starts (stacked experts are drawn and read one expert at a time)."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        widths = [self.vocab_size, self.intermediate_size, q, kv]
        if self.num_experts:
            widths += [self.moe_intermediate_size, self.shared_expert_intermediate_size]
        return h * max(widths)

    def num_params(self) -> int:
        dense = self.num_layers - self.num_moe_layers
        head = self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        layers = dense * self.layer_params(False) + self.num_moe_layers * self.layer_params(True)
        return layers + head + self.hidden_size

    def active_params(self) -> int:
        """Matmul parameters one token uses (embedding lookup excluded; MoE: top-k)."""
        n = self.num_params() - self.embedding_params() * (0 if self.tie_word_embeddings else 1)
        if self.num_moe_layers:
            per_expert = 3 * self.hidden_size * self.moe_intermediate_size
            unused = self.num_experts - self.num_experts_per_tok
            n -= self.num_moe_layers * unused * per_expert
        return n


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout and the memory options of one candidate."""

    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    """Pipeline stages per rank (Interleaved1F1B)."""
    pp_schedule: str = "1F1B"
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    ac: str = "none"
    """Recompute per block: none, selective or full."""
    micro_batch: int = 1
    activation_offload: bool = False
    """Saved activations of every block go to host memory (accelerators)."""
    optimizer_offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer states in host memory."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "virtual_stages", "cp", "ep", "dp_shard", "dp_replicate",
                     "micro_batch"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout {name}={value!r} must be a positive integer")
        if self.ac not in AC_MODES:
            raise ConfigError(f"layout ac={self.ac!r}; choose one of {AC_MODES}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"layout pp_schedule={self.pp_schedule!r}; one of {PP_SCHEDULES}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_shard * self.dp_replicate

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def fsdp(self) -> int:
        """Ranks that shard the same parameters (FSDP over dp_shard x cp)."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "cp", "ep", "dp_shard",
                 "dp_replicate") if getattr(self, k) > 1]  # fmt: skip
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"mb{self.micro_batch}")
        if self.ac != "none":
            parts.append(f"ac={self.ac}")
        if self.activation_offload:
            parts.append("act_offload")
        if self.optimizer_offload:
            parts.append("opt_offload")
        return " ".join(parts) or "single"


@dataclass(frozen=True, kw_only=True)
class Job:
    """The training job every layout must run."""

    seq_len: int
    global_batch: int
    """Samples per optimizer step over all data-parallel ranks."""
    precision: str = "fp32"
    """Compute dtype; master weights, gradients and optimizer states stay fp32."""
    packed: bool = True
    """Documents packed with `cu_seqlens` (the trainer's default)."""
    device: str = "cuda"
    """Device type the job runs on: "cpu" (mindspeed-ops' composed attention builds fp32
    seq x seq scores; host memory is device memory, so offloading saves nothing), "cuda"
    or "npu" (fused attention without a score matrix)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; choose one of {list(PRECISIONS)}")
        for name in ("seq_len", "global_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.device not in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device={self.device!r}; choose one of cpu, cuda, npu")

    @property
    def element_size(self) -> int:
        return PRECISIONS[self.precision]

    def grad_accum(self, layout: Layout) -> int:
        """Micro-batches per rank per step (0 when the batch does not divide)."""
        per_step = layout.micro_batch * layout.dp
        return self.global_batch // per_step if self.global_batch % per_step == 0 else 0


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
