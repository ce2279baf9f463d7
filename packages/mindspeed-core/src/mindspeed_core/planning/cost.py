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
  backward, gradients reduce-scattered, every micro-batch; under expert parallel a rank
  gathers only its 1/ep of the routed experts, over the dp_shard x cp / ep ranks that hold
  the same experts), replicated data parallel (an all-reduce of the gradients), context
  parallel (K/V round the ring, forward; K/V and dK/dV backward), expert parallel (per MoE
  block and micro-batch the routed rows, top-k copies of every token, go to their experts'
  ranks and come back: two all-to-alls forward, two backward, two more when recompute
  repeats the experts' forward; each moves (ep - 1) / ep of the rows and is not overlapped),
  pipeline sends; FSDP's and the ring's traffic overlaps compute by the calibrated
  `overlap` fraction. A collective whose ranks span several nodes runs at
  `inter_node_bandwidth` (ranks are laid out as `ParallelDims` does: tp innermost, then
  cp, dp_shard, dp_replicate, pp);
- MoE compute: tensor parallel splits attention, dense MLPs and shared experts, while
  every tp rank runs the routed experts on all tokens of the micro-batch (they stay whole
  under tp); expert parallel leaves a rank's expert FLOPs unchanged on balanced loads;
  selective recompute redoes the experts' grouped GEMMs (not in its save list);
- bubble: 1F1B and GPipe idle (pp - 1) / micro-batches of the compute, interleaved
  (pp - 1) / (virtual stages x micro-batches).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mindspeed_core.planning.memory import rank_layers
from mindspeed_core.planning.shape import Job, Layout, ModelShape, ceil_div

_FP32 = 4


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
    """Bytes per second one rank moves in a ring collective (inside a node)."""
    inter_node_bandwidth: float | None = None
    """Bytes per second one rank moves in a collective whose ranks span nodes (not
    calibrated: one machine cannot measure it); None: `bandwidth`."""
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
        (~40% of its bf16 peak, NVLink inside a node, a 200-400 Gb/s NIC per device between
        nodes), an NPU alike, or one CPU core with gloo."""
        if device == "cpu":
            return cls(device="cpu (default)", flops_per_s=2e10, block_overhead_s=2e-3,
                       latency_s=2e-4, bandwidth=1e9, overlap=0.0)  # fmt: skip
        return cls(device=f"{device} (default)", flops_per_s=4e14, block_overhead_s=2e-4,
                   latency_s=3e-5, bandwidth=1e11, inter_node_bandwidth=2.5e10,
                   overlap=0.8)  # fmt: skip


@dataclass(kw_only=True)
class StepTime:
    """Seconds per optimizer step of the slowest rank."""

    compute: float
    tp_comm: float
    dp_comm: float
    cp_comm: float
    pp_comm: float
    bubble: float
    ep_comm: float = 0.0
    """Expert parallel's all-to-alls."""
    offload: float = 0.0
    total: float


def _ring(bytes_: float, ranks: int, calib: Calibration, factor: float = 1.0,
          bandwidth: float | None = None) -> float:  # fmt: skip
    """One ring collective: all-gather / reduce-scatter (factor 1) or all-reduce (2)."""
    if ranks <= 1:
        return 0.0
    return calib.latency_s + factor * bytes_ * (ranks - 1) / ranks / (bandwidth or calib.bandwidth)


@dataclass(frozen=True)
class _Network:
    """The bandwidth of each group of a layout: inside a node, or across nodes where the
    group's ranks (stride x size consecutive ranks) do not fit in one."""

    layout: Layout
    calib: Calibration
    per_node: int | None

    def bandwidth(self, stride: int, size: int) -> float:
        across = self.per_node is not None and size > 1 and stride * size > self.per_node
        inter = self.calib.inter_node_bandwidth
        return inter if across and inter else self.calib.bandwidth

    def group(self, name: str) -> float:
        lay = self.layout
        groups = {  # name: (stride, size) in the rank order of ParallelDims
            "tp": (1, lay.tp),
            "cp": (lay.tp, lay.cp),
            "fsdp": (lay.tp, lay.fsdp),
            "ep": (lay.tp, lay.ep),
            "expert_fsdp": (lay.tp * lay.ep, lay.fsdp // lay.ep),
            "dp_replicate": (lay.tp * lay.fsdp, lay.dp_replicate),
            "pp": (lay.tp * lay.fsdp * lay.dp_replicate, lay.pp),
        }
        return self.bandwidth(*groups[name])


def _block_flops(shape: ModelShape, job: Job, layout: Layout) -> float:
    """Training FLOPs per token of an average block on a rank, its recompute included:
    tensor parallel splits all but the routed experts (whole on every tp rank)."""
    head_params = shape.vocab_size * shape.hidden_size  # the output layer's matmul
    block_params = (shape.active_params() - head_params) / shape.num_layers
    routed = 0.0
    if shape.num_moe_layers:  # the top-k experts a token uses
        active = shape.num_experts_per_tok * 3 * shape.hidden_size * shape.moe_intermediate_size
        routed = active * shape.num_moe_layers / shape.num_layers
    dense = block_params - routed
    # causal attention: QK^T and PV over half the square, forward + backward
    attention = 6 * shape.num_heads * shape.head_dim * job.seq_len
    split, whole = 6 * dense + attention, 6 * routed
    if layout.ac == "full":  # the forward again
        split, whole = split + 2 * dense + attention / 3, whole + 2 * routed
    elif layout.ac == "selective":
        # selective recompute saves matmuls and attention, not the grouped expert GEMMs
        split, whole = split + attention / 3, whole + 2 * routed
    return split / layout.tp + whole


def step_flops(shape: ModelShape, layout: Layout, job: Job, average: bool = False) -> float:
    """Training FLOPs of the busiest rank in one step (`average`: of the average rank)."""
    tokens = job.global_batch * job.seq_len / (layout.dp * layout.cp)
    head = 6 * shape.vocab_size * shape.hidden_size / layout.tp
    per_block = _block_flops(shape, job, layout)
    work = [b * per_block + (head if last else 0) for b, _, last in rank_layers(shape, layout)]
    return (sum(work) / len(work) if average else max(work)) * tokens


def estimate_step_time(shape: ModelShape, layout: Layout, job: Job, calib: Calibration,
                       devices_per_node: int | None = None) -> StepTime:  # fmt: skip
    """Predicted seconds per step (see the module docstring); `devices_per_node`: where
    groups span nodes (None: one node)."""
    net = _Network(layout, calib, devices_per_node)
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
    tp = blocks * accum * per_block * _ring(act, layout.tp, calib, factor, net.group("tp")) / (
        2 if layout.sequence_parallel else 1
    )
    dp = accum * _fsdp_time(shape, layout, job, calib, net)
    if layout.fsdp > 1 or layout.dp_replicate > 1:
        dp += calib.fsdp_overhead_s * blocks * accum
    if layout.tp > 1:
        tp += calib.tp_overhead_s * blocks * accum
    kv = tokens_mb * 2 * ceil_div(shape.num_kv_heads, layout.tp) * shape.head_dim * e
    cp = 3 * blocks * accum * (layout.cp - 1) * (calib.latency_s + kv / net.group("cp"))
    pp = 2 * accum * (calib.latency_s + act / net.group("pp")) if layout.pp > 1 else 0.0
    ep = accum * _all_to_all_time(shape, layout, job, calib, net, blocks)
    offload = _offload_time(shape, layout, job, calib)
    hidden = calib.overlap * min(dp + cp + offload[0], compute)
    stages = layout.pp * layout.virtual_stages
    bubble = compute * (layout.pp - 1) / (accum * stages / layout.pp) if layout.pp > 1 else 0.0
    bubble = 0.0 if calib.ranks_share_cores else bubble
    total = compute + tp + dp + cp + pp + ep + bubble + sum(offload) - hidden
    return StepTime(compute=compute, tp_comm=tp, dp_comm=dp, cp_comm=cp, pp_comm=pp,
                    bubble=bubble, ep_comm=ep, offload=sum(offload), total=total)  # fmt: skip


def _fsdp_time(shape: ModelShape, layout: Layout, job: Job, calib: Calibration,
               net: _Network) -> float:  # fmt: skip
    """FSDP's and replicated data parallel's traffic for one micro-batch: the parameters
    gathered in forward and backward (compute dtype), the gradients reduce-scattered (fp32)
    and all-reduced over the replicas. Routed experts: whole on every tp rank, and under
    expert parallel only a rank's 1/ep, over the ranks that hold the same experts."""
    e = job.element_size
    experts = shape.num_moe_layers * shape.routed_expert_params()
    dense = (shape.num_params() - experts) / layout.tp / layout.pp
    mine = experts / layout.pp / layout.ep
    out = 0.0
    for params, ranks, group in ((dense, layout.fsdp, "fsdp"),
                                 (mine, layout.fsdp // layout.ep, "expert_fsdp")):  # fmt: skip
        if not params:
            continue
        bandwidth = net.group(group)
        out += 2 * _ring(params * e, ranks, calib, 1.0, bandwidth)
        out += _ring(params * _FP32, ranks, calib, 1.0, bandwidth)
    replicated = (dense / layout.fsdp + mine / max(layout.fsdp // layout.ep, 1)) * _FP32
    out += _ring(replicated, layout.dp_replicate, calib, 2.0, net.group("dp_replicate"))
    return out


def _all_to_all_time(shape: ModelShape, layout: Layout, job: Job, calib: Calibration,
                     net: _Network, blocks: float) -> float:  # fmt: skip
    """Expert parallel's dispatch and combine for one micro-batch on the busiest rank:
    every tp rank sends the top-k copies of the micro-batch's tokens (the sequence is
    gathered around the MoE block) and (ep - 1) / ep of them leave the rank."""
    if layout.ep == 1 or not shape.num_moe_layers:
        return 0.0
    moe_blocks = blocks * shape.num_moe_layers / shape.num_layers
    rows = layout.micro_batch * job.seq_len / layout.cp * shape.num_experts_per_tok
    moved = rows * shape.hidden_size * job.element_size * (layout.ep - 1) / layout.ep
    # dispatch + combine, forward and backward, and again where recompute redoes the
    # forward of the experts (full, and selective: it saves no grouped GEMM)
    calls = 4 + (2 if layout.ac != "none" else 0)
    # each all-to-all also exchanges the per-expert counts first (one more latency)
    one = 2 * calib.latency_s + moved / net.group("ep")
    return moe_blocks * calls * one


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
