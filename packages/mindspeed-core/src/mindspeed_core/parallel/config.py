"""`ParallelConfig`: the `parallel` section of every command's config, and its `ParallelDims`.

The YAML keys and `--parallel.<field>` spellings are those of `mindspeed pretrain`; an
embedder of core puts the same section in its own config tree and calls `.dims()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel.dims import ParallelDims


@dataclass(kw_only=True)
class ParallelConfig:
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
    ep_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How expert parallel moves tokens: all-to-all (each row to its expert's rank) or
    all-gather (every rank gathers every row, results summed back; simpler, ep x traffic)."""
    dp_shard: int = -1
    """FSDP degree; -1 takes the processes the other degrees leave."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP when dp_shard > 1)."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence when tp > 1."""
    loss_parallel: bool = True
    """Keep logits vocab-sharded for the loss when tp > 1."""
    activation_offload: bool = False
    """Keep each block's saved activations in pinned host memory until its backward
    (accelerators only; not with recompute)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of sharded parameters, gradients and optimizer states
    (accelerators only; needs dp_shard x cp > 1)."""

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

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The layout's `ParallelDims` (validated against the world size; no process group
        is created until `.build()`)."""
        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            ep=self.ep,
            pp=self.pp,
            cp=self.cp,
            world_size=world_size,
        )
