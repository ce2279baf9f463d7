"""Predicted step time of a layout: compute / calibrated throughput + communication volume /
calibrated bandwidth + pipeline bubble.

- compute: training FLOPs a rank does per step (6 x active parameters x tokens + causal
  attention, plus the recomputed forward: full recompute redoes the whole block, selective
  only attention), divided by tensor and pipeline parallel, at the calibrated FLOP/s, plus
  a fixed cost per block and micro-batch (launches, Python; it is what makes small
  micro-batches slow);
- communication per step, each collective as latency + bytes / bandwidth: tensor parallel
  (2 all-reduces, or all-gather + reduce-scatter under sequence parallel, per block and
  micro-batch, forward and backward), FSDP (parameters gathered in forward and again in
  backward, gradients reduce-scattered, every micro-batch), replicated data parallel (an
  all-reduce of the gradients), context parallel (K/V round the ring, forward; K/V and
  dK/dV backward), pipeline sends; FSDP's and the ring's traffic overlaps compute by the
  calibrated `overlap` fraction;
- bubble: 1F1B and GPipe idle (pp - 1) / micro-batches of the compute, interleaved
  (pp - 1) / (virtual stages x micro-batches).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mindspeed_core.planning.memory import rank_layers
from mindspeed_core.planning.shape import Job, Layout, ModelShape, ceil_div


@dataclass(kw_only=True)
class Calibration:
    """Measured constants of one machine (see `mindspeed_tools.plan --calibrate`)."""

    device: str = "unknown"
    flops_per_s: float = 1e11
    """Achieved training FLOP/s of one rank on large micro-batches."""
    block_overhead_s: float = 1e-4
    """Fixed time per block per micro-batch (forward + backward)."""
    tp_overhead_s: float = 0.0
    """Extra time per block per micro-batch under tensor parallel (DTensor dispatch,
    small collectives), beyond the modelled traffic."""
    fsdp_overhead_s: float = 0.0
    """Extra time per block per micro-batch under FSDP (copy-in/out of the gathered
    parameters and reduced gradients), beyond the modelled traffic."""
    latency_s: float = 1e-4
    """Per collective call."""
    bandwidth: float = 1e9
    """Bytes per second one rank moves in a ring collective."""
    overlap: float = 0.0
    """Fraction of FSDP/ring traffic hidden behind compute (0..1)."""
    ranks_share_cores: bool = False
    """Calibrated on a CPU with fewer cores than ranks (one thread each): the ranks share the
    cores, so a step takes the ranks' average work (a pipeline rank idle in a bubble or
    lighter than the busiest lends its core to the others), not the busiest rank's plus the
    bubble. With a core per rank an idle rank's core idles with it: the bubble counts."""
    host_bandwidth: float = 2e10
    """Bytes per second between device and pinned host memory (offload; not calibrated)."""
    host_adam_s: float = 2e-9
    """Seconds per parameter of AdamW on the host (optimizer offload; not calibrated)."""
    measured: dict = field(default_factory=dict)
    """The runs the constants were fitted to."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def default(cls, device: str) -> Calibration:
        """Round numbers for a device type when nothing was measured: an H100-class GPU
        (~40% of its bf16 peak, NVLink), an NPU alike, or one CPU core with gloo."""
        if device == "cpu":
            return cls(device="cpu (default)", flops_per_s=2e10, block_overhead_s=2e-3,
                       latency_s=2e-4, bandwidth=1e9, overlap=0.0)  # fmt: skip
        return cls(device=f"{device} (default)", flops_per_s=4e14, block_overhead_s=2e-4,
                   latency_s=3e-5, bandwidth=1e11, overlap=0.8)  # fmt: skip


@dataclass(kw_only=True)
class StepTime:
    """Seconds per optimizer step of the slowest rank."""

    compute: float
    tp_comm: float
    dp_comm: float
    cp_comm: float
    pp_comm: float
    bubble: float
    offload: float = 0.0
    total: float


def _ring(bytes_: float, ranks: int, calib: Calibration, factor: float = 1.0) -> float:
    """One ring collective: all-gather / reduce-scatter (factor 1) or all-reduce (2)."""
    if ranks <= 1:
        return 0.0
    return calib.latency_s + factor * bytes_ * (ranks - 1) / ranks / calib.bandwidth


def step_flops(shape: ModelShape, layout: Layout, job: Job, average: bool = False) -> float:
    """Training FLOPs of the busiest rank in one step (`average`: of the average rank)."""
    tokens = job.global_batch * job.seq_len / (layout.dp * layout.cp)
    head_params = shape.vocab_size * shape.hidden_size  # the output layer's matmul
    block_params = (shape.active_params() - head_params) / shape.num_layers
    # causal attention: QK^T and PV over half the square, forward + backward
    attention = 6 * shape.num_heads * shape.head_dim * job.seq_len
    per_block = 6 * block_params + attention
    if layout.ac == "full":
        per_block += 2 * block_params + attention / 3
    elif layout.ac == "selective":
        per_block += attention / 3
    stages = rank_layers(shape, layout)
    work = [b * per_block + (6 * head_params if last else 0) for b, _, last in stages]
    return (sum(work) / len(work) if average else max(work)) * tokens / layout.tp


def estimate_step_time(shape: ModelShape, layout: Layout, job: Job, calib: Calibration) -> StepTime:
    """Predicted seconds per step (see the module docstring)."""
    accum = max(job.grad_accum(layout), 1)
    tokens_mb = layout.micro_batch * job.seq_len / layout.cp
    counts = [b for b, _, _ in rank_layers(shape, layout)]
    blocks = sum(counts) / len(counts) if calib.ranks_share_cores else max(counts)
    passes = 3 if layout.ac == "none" else 4  # forward, backward (2x), recomputed forward
    shared = calib.ranks_share_cores
    compute = step_flops(shape, layout, job, average=shared) / calib.flops_per_s
    compute += calib.block_overhead_s * blocks * accum * passes / 3
    e, h = job.element_size, shape.hidden_size
    act = tokens_mb * h * e
    per_block = 4 * (2 if layout.sequence_parallel else 1)  # all-reduces, or AG + RS pairs
    factor = 1.0 if layout.sequence_parallel else 2.0
    tp = blocks * accum * per_block * _ring(act, layout.tp, calib, factor) / (
        2 if layout.sequence_parallel else 1
    )
    params = shape.num_params() / layout.tp / layout.pp
    dp = accum * (2 * _ring(params * e, layout.fsdp, calib) + _ring(params * 4, layout.fsdp, calib))
    dp += accum * _ring(params * 4 / layout.fsdp, layout.dp_replicate, calib, 2.0)
    if layout.fsdp > 1 or layout.dp_replicate > 1:
        dp += calib.fsdp_overhead_s * blocks * accum
    if layout.tp > 1:
        tp += calib.tp_overhead_s * blocks * accum
    kv = tokens_mb * 2 * ceil_div(shape.num_kv_heads, layout.tp) * shape.head_dim * e
    cp = 3 * blocks * accum * (layout.cp - 1) * (calib.latency_s + kv / calib.bandwidth)
    pp = 2 * accum * (calib.latency_s + act / calib.bandwidth) if layout.pp > 1 else 0.0
    offload = _offload_time(shape, layout, job, calib)
    hidden = calib.overlap * min(dp + cp + offload[0], compute)
    stages = layout.pp * layout.virtual_stages
    bubble = compute * (layout.pp - 1) / (accum * stages / layout.pp) if layout.pp > 1 else 0.0
    bubble = 0.0 if calib.ranks_share_cores else bubble
    total = compute + tp + dp + cp + pp + bubble + sum(offload) - hidden
    return StepTime(compute=compute, tp_comm=tp, dp_comm=dp, cp_comm=cp, pp_comm=pp,
                    bubble=bubble, offload=sum(offload), total=total)  # fmt: skip


def _offload_time(shape, layout, job, calib) -> tuple[float, float]:
    """(activation copies, which overlap compute; optimizer offload, which does not)."""
    act = opt = 0.0
    if layout.activation_offload:
        from mindspeed_core.planning.memory import estimate_memory

        act = 2 * estimate_memory(shape, layout, job).host / calib.host_bandwidth
    if layout.optimizer_offload:
        params = shape.num_params() / (layout.tp * layout.pp * layout.fsdp)
        opt = 8 * params / calib.host_bandwidth + params * calib.host_adam_s
    return act, opt
