"""Predicted memory per rank of one training step: parameters, gradients, optimizer states,
activations and buffers, and the peak.

The activation terms are what our modules actually keep for backward (read from
mindspeed-llm's decoder and mindspeed-ops' autograd functions, and checked in the tests
against saved-tensor hooks), per block of T tokens on a rank (T = micro_batch x seq / cp):

===================== ========================================= ===========================
tensor                saved by                                  bytes (e = compute dtype)
===================== ========================================= ===========================
block input x         rms_norm (x, fp32 rstd)                   T h e / sp + 4 T / sp
norm output           wq/wk/wv matmuls (gathered under sp)      T h e
q, k after RoPE, v    attention (q, k, v, out, fp32 lse)        T (hq + 2 hkv) e
attention output      attention and wo                          T hq e + 4 T Hq
residual h            rms_norm                                  T h e / sp + 4 T / sp
norm output           w1/w3 matmuls                             T h e
w1 x, w3 x, swiglu    swiglu (both inputs), w2 (its input)      3 T I e
qk-norm (per head)    rms_norm over q and k heads               T (hq + hkv) e + 4 T (Hq + Hkv)
===================== ========================================= ===========================

(hq = Hq/tp x head_dim, hkv likewise, I = intermediate/tp, sp = tp under sequence parallel.)
Rotary keeps only positions and the shared tables. Full recompute keeps the block input;
selective keeps it and the matmul outputs (q, k, v projections, wo, w1, w3, w2; our
attention op is not in torchtitan's save list, so it is recomputed). During a block's
backward the recomputed activations are live again, with the gradient buffers.

Start-up (the model built on the meta device, then each rank's shards materialised and
filled one tensor at a time) holds the rank's parameters, buffers and one whole tensor; it
is one of the moments the peak is taken over, so a layout whose start-up does not fit is
refused like one whose step does not.

The peak is the largest of these moments of a steady-state step (optimizer states exist,
gradients were set to None by zero_grad): the start of the loss backward, each block's
backward (activations of the blocks before it, gradients of those after it, FSDP's
gathered parameters and gradients, the block's recomputed activations and gradient
buffers), and the optimizer step (foreach AdamW keeps one parameter-sized temporary).
With gradient accumulation or a pipeline, the later micro-batches also hold every
gradient; a pipeline rank holds the activations of its in-flight micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindspeed_core.planning.shape import Job, Layout, ModelShape, ceil_div

_FP32 = 4
_INT64 = 8
# mindspeed_ops.cross_entropy: fp32 elements of one chunk of logits (CPU / accelerators).
_CE_CHUNK = {"cpu": 1 << 22}
_CE_CHUNK_ACCELERATOR = 1 << 26


@dataclass(kw_only=True)
class MemoryEstimate:
    """Bytes per rank (the busiest rank: the first pipeline stage by default)."""

    params: int
    """Master parameters on the device (sharded; fp32)."""
    grads: int
    """Sharded gradients after the step's reductions (fp32)."""
    optimizer: int
    """AdamW's two moments (fp32)."""
    activations: int
    """Saved for backward at the end of the forward (all in-flight micro-batches)."""
    buffers: int
    """Other persistent device memory: RoPE tables, pipeline receive buffers."""
    peak: int
    """The largest live total during the step (see the module docstring)."""
    host: int = 0
    """Host memory taken by offloading (optimizer states, activations)."""
    startup: int = 0
    """While the model starts, before the first step: this rank's shards (built on the
    meta device, then materialised) plus the largest tensor drawn or read whole and its
    block (a phase of `peak` too)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Live total at each moment considered (for reading the estimate)."""

    def as_gib(self) -> dict[str, float]:
        names = ("params", "grads", "optimizer", "activations", "buffers", "peak", "host", "startup")
        return {k: getattr(self, k) / 2**30 for k in names}


@dataclass(frozen=True)
class _Sizes:
    """Per-block and per-head quantities of one rank (bytes unless stated)."""

    layer_params: int  # elements of one block on this rank (after tp, before FSDP)
    gathered_params: int  # elements of one block as FSDP gathers it (experts: this rank's 1/ep)
    head_params: int  # embedding + output + final norm on this rank (elements)
    saved: int  # one block's saved activations, this recompute mode
    saved_none: int  # the same without recompute (live again during its backward)
    attn_part: int  # what a block keeps up to its attention kernel, this recompute mode
    backward_mlp: int  # a block's backward at swiglu: its activations + gradient buffers
    backward_attn: int  # ... at the attention kernel (the MLP's activations are gone)
    forward_temp: int  # workspace inside the attention kernel's forward
    head_saved: int  # final norm, output-layer input, logits kept by the loss
    loss_temp: int  # the loss backward: logits gradient and its fp32 chunk
    embed_saved: int  # token and position ids


def _heads(shape: ModelShape, tp: int) -> tuple[int, int]:
    return ceil_div(shape.num_heads, tp), max(ceil_div(shape.num_kv_heads, tp), 1)


def _block_saved(shape: ModelShape, layout: Layout, job: Job, tokens: int, ac: str) -> int:
    """Bytes one block keeps for backward for `tokens` tokens of this rank."""
    e, h, tp = job.element_size, shape.hidden_size, layout.tp
    sp = tp if layout.sequence_parallel and tp > 1 else 1
    heads, kv_heads = _heads(shape, tp)
    hq, hkv = heads * shape.head_dim, kv_heads * shape.head_dim
    inter = _mlp_width(shape, tp)
    residual = tokens * h * e // sp + _FP32 * tokens // sp
    if ac == "full":
        return tokens * h * e // sp
    if ac == "selective":
        mm = tokens * (hq + 2 * hkv) * e + 2 * tokens * h * e + 2 * tokens * inter * e
        return tokens * h * e // sp + mm
    attn = tokens * h * e + tokens * (2 * hq + 2 * hkv) * e + _FP32 * tokens * heads
    if shape.qk_norm:
        attn += tokens * (hq + hkv) * e + _FP32 * tokens * (heads + kv_heads)
    mlp = tokens * h * e + 3 * tokens * inter * e + _moe_extra(shape, layout, job, tokens)
    return 2 * residual + attn + mlp


def _attention_saved(shape: ModelShape, layout: Layout, job: Job, tokens: int) -> int:
    """What a block without recompute keeps up to and including its attention kernel."""
    e, h, tp = job.element_size, shape.hidden_size, layout.tp
    sp = tp if layout.sequence_parallel and tp > 1 else 1
    heads, kv_heads = _heads(shape, tp)
    hq, hkv = heads * shape.head_dim, kv_heads * shape.head_dim
    saved = tokens * h * e // sp + _FP32 * tokens // sp + tokens * h * e
    saved += tokens * (2 * hq + 2 * hkv) * e + _FP32 * tokens * heads
    if shape.qk_norm:
        saved += tokens * (hq + hkv) * e + _FP32 * tokens * (heads + kv_heads)
    return saved


def _mlp_width(shape: ModelShape, tp: int) -> int:
    if shape.num_experts:  # routed tokens: top-k rows of the expert width (no tp on experts)
        shared = ceil_div(shape.shared_expert_intermediate_size, tp)
        return shape.num_experts_per_tok * shape.moe_intermediate_size + shared
    return ceil_div(shape.intermediate_size, tp)


def _moe_extra(shape: ModelShape, layout: Layout, job: Job, tokens: int) -> int:
    """What a MoE block keeps besides its experts' SwiGLU (MoE only): the router's fp32
    logits and probabilities, and three copies of the routed rows (top-k per token): the
    rows dispatched to the experts (the grouped GEMMs' input), the experts' output rows
    (kept by the `index_copy` that puts them back in token order) and those rows in token
    order (kept by the multiplication with the routing weights)."""
    if not shape.num_experts:
        return 0
    rows = tokens * shape.num_experts_per_tok
    return 2 * _FP32 * tokens * shape.num_experts + 3 * rows * shape.hidden_size * job.element_size


def _attention_workspace(shape: ModelShape, layout: Layout, job: Job, tokens: int) -> int:
    """fp32 score matrices of the composed kernel, one document (here: one sequence)."""
    if job.device != "cpu":
        return 0
    heads, _ = _heads(shape, layout.tp)
    seg = min(job.seq_len // layout.cp, tokens)
    return 2 * _FP32 * heads * seg * seg


def _sizes(shape: ModelShape, layout: Layout, job: Job) -> _Sizes:
    e, h, tp = job.element_size, shape.hidden_size, layout.tp
    tokens = layout.micro_batch * job.seq_len // layout.cp
    heads, kv_heads = _heads(shape, tp)
    hq, hkv = heads * shape.head_dim, kv_heads * shape.head_dim
    inter = _mlp_width(shape, tp)
    sp = tp if layout.sequence_parallel and tp > 1 else 1
    vocab = ceil_div(shape.vocab_size, tp) if layout.loss_parallel or tp == 1 else shape.vocab_size
    workspace = _attention_workspace(shape, layout, job, tokens)
    saved_none = _block_saved(shape, layout, job, tokens, "none")
    attn_none = _attention_saved(shape, layout, job, tokens)
    # swiglu's backward: d(residual), d(its output), and its two input gradients (w2's
    # saved input is already freed)
    backward_mlp = saved_none + tokens * h * e + 2 * tokens * inter * e
    if shape.num_experts:  # and the routed rows' gradients: d(weighted rows), d(expert
        # output), d(dispatched rows) from w1 and from w3 before they are summed
        backward_mlp += 2 * tokens * shape.num_experts_per_tok * h * e
    # attention's backward: d(residual), d(out), dq/dk/dv, the kernel's fp32 workspace
    backward_attn = attn_none + tokens * (2 * h + 2 * hq + 2 * hkv) * e + 3 * workspace // 2
    layer_elems = _tp_layer_params(shape, tp)
    chunk_rows = max(1, _CE_CHUNK.get(job.device, _CE_CHUNK_ACCELERATOR) // vocab)
    logits = tokens * vocab * e
    # mindspeed_ops' chunked loss keeps the logits; its backward writes their gradient from
    # an fp32 chunk. Under loss parallel torch's kernel keeps the fp32 log-softmax and its
    # backward holds three fp32 copies. (Without loss parallel, tp gathers whole logits; gloo's
    # gather buffer is sometimes still alive at the peak: up to one more logits copy.)
    loss_temp = logits + min(chunk_rows, tokens) * vocab * _FP32
    if tp > 1 and layout.loss_parallel:
        logits, loss_temp = tokens * vocab * _FP32, 3 * tokens * vocab * _FP32
    head_saved = tokens * h * e // sp + _FP32 * tokens // sp + tokens * h * e + logits
    head_saved += _FP32 * tokens  # the loss's log-sum-exp
    return _Sizes(
        layer_params=layer_elems,
        gathered_params=_tp_layer_params(shape, tp, layout.ep),
        head_params=_tp_head_params(shape, tp),
        saved=_block_saved(shape, layout, job, tokens, layout.ac),
        saved_none=saved_none,
        attn_part=attn_none if layout.ac == "none" else 0,
        backward_mlp=backward_mlp,
        backward_attn=backward_attn,
        forward_temp=workspace,
        head_saved=head_saved,
        loss_temp=loss_temp,
        embed_saved=2 * _INT64 * tokens,
    )


def _tp_layer_params(shape: ModelShape, tp: int, ep: int = 1) -> int:
    """Elements of one (dense-average) block on a tensor-parallel rank; with `ep` > 1 the
    routed experts a rank computes with (1/ep of them: expert parallel places each expert's
    weights on one ep rank, FSDP shards the rest of the block). Tensor parallel splits
    attention, dense MLPs and shared experts but leaves the routed experts whole on every
    tp rank (`mindspeed_llm.models.common.tp_plan`)."""
    norms = 2 * shape.hidden_size + (2 * shape.head_dim if shape.qk_norm else 0)
    dense = (shape.layer_params(False) - norms) // tp + norms
    if not shape.num_moe_layers:
        return dense
    experts = shape.routed_expert_params()
    moe = (shape.layer_params(True) - experts - norms) // tp + norms + experts // ep
    total = (shape.num_layers - shape.num_moe_layers) * dense + shape.num_moe_layers * moe
    return total // shape.num_layers


def _tp_head_params(shape: ModelShape, tp: int) -> int:
    """Embedding, output layer (unless tied) and final norm on a tensor-parallel rank."""
    tables = 1 if shape.tie_word_embeddings else 2
    return tables * ceil_div(shape.vocab_size, tp) * shape.hidden_size + shape.hidden_size


def rank_layers(shape: ModelShape, layout: Layout) -> list[tuple[int, bool, bool]]:
    """(blocks, has the embedding, has the output layer) of each pipeline rank."""
    stages = layout.pp * layout.virtual_stages
    base, extra = divmod(shape.num_layers, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    out = []
    for r in range(layout.pp):
        mine = range(r, stages, layout.pp)
        out.append((sum(counts[s] for s in mine), 0 in mine, stages - 1 in mine))
    return out


def in_flight(layout: Layout, rank: int, num_microbatches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once (in units of the
    rank's whole set of blocks)."""
    pp, v = layout.pp, layout.virtual_stages
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "GPipe":
        return float(num_microbatches)
    if v == 1:
        return float(min(pp - rank, num_microbatches))
    warmup = (v - 1) * pp + 2 * (pp - 1 - rank)  # torch's Interleaved1F1B warm-up chunks
    return min(warmup + 1, num_microbatches * v) / v


def estimate_memory(shape: ModelShape, layout: Layout, job: Job) -> MemoryEstimate:
    """Predicted bytes of the busiest rank of `layout` training `shape` on `job`."""
    return max(estimate_memory_per_stage(shape, layout, job), key=lambda m: m.peak)


def estimate_memory_per_stage(shape: ModelShape, layout: Layout, job: Job) -> list[MemoryEstimate]:
    """Predicted bytes of a rank of each pipeline rank (index = pp rank)."""
    return [
        _estimate_rank(shape, layout, job, r, blocks, first, last)
        for r, (blocks, first, last) in enumerate(rank_layers(shape, layout))
    ]


@dataclass(frozen=True)
class _Rank:
    """Persistent bytes of one pipeline rank and the scalars its moments need."""

    head_elems: int  # embedding / output / final norm elements on this rank
    params: int
    optimizer: int
    grads: int  # sharded gradients after the step
    host: int  # offloaded optimizer state
    buffers: int  # RoPE tables and pipeline receive buffers
    unit: int  # bytes of a gathered (FSDP) or autocast parameter element
    base: int  # everything live across the step's moments


def _persistent(shape, layout, job, s: _Sizes, blocks, first, last) -> _Rank:
    e, fsdp = job.element_size, layout.fsdp
    embedding = ceil_div(shape.vocab_size, layout.tp) * shape.hidden_size
    head_elems = (embedding if first else 0) + (s.head_params - embedding if last else 0)
    if shape.tie_word_embeddings and layout.pp == 1:
        head_elems = s.head_params
    elif shape.tie_word_embeddings and last:  # the last stage's own copy of the tied table
        head_elems += embedding
    elems = blocks * s.layer_params + head_elems
    params = _FP32 * ceil_div(elems, fsdp)
    optimizer, host = 2 * params, 0
    if layout.optimizer_offload:  # FSDP2 CPU offload: master weights, grads, moments on host
        host, params, optimizer = 4 * params, 0, 0
    accum = max(job.grad_accum(layout), 1)
    buffers = _FP32 * shape.max_position_embeddings * shape.head_dim
    buffers += _p2p_buffers(shape, layout, job, first, last, accum)
    # compute copies: FSDP's gathered root (param dtype) or autocast's bf16 weights
    unit = e if fsdp > 1 or layout.dp_replicate > 1 else _FP32
    root = head_elems * unit if fsdp > 1 else 0
    autocast = elems * e if e != _FP32 and fsdp == 1 and layout.dp_replicate == 1 else 0
    return _Rank(head_elems=head_elems, params=params, optimizer=optimizer,
                 grads=0 if layout.optimizer_offload else params, host=host, buffers=buffers,
                 unit=unit, base=params + optimizer + buffers + root + autocast)  # fmt: skip


def _estimate_rank(shape, layout, job, rank, blocks, first, last) -> MemoryEstimate:
    s = _sizes(shape, layout, job)
    r = _persistent(shape, layout, job, s, blocks, first, last)
    fsdp, flight = layout.fsdp, in_flight(layout, rank, max(job.grad_accum(layout), 1))
    # A micro-batch after the first holds every gradient, with as many activations in
    # flight as the first (a pipeline in steady state); a pipeline whose micro-batches are
    # all in flight at once starts its backward with no gradient yet.
    grads_live = r.grads if max(job.grad_accum(layout), 1) > max(flight, 1) else 0
    saved_blocks = blocks * s.saved
    head_act = (s.head_saved if last else 0) + (s.embed_saved if first else 0)
    activations = int(flight * (saved_blocks + head_act))
    # the activations of every other block of every in-flight micro-batch
    before = int((blocks * flight - 1) * s.saved) if blocks else 0
    embed = s.embed_saved * flight if first else 0
    host = r.host
    if layout.activation_offload and job.device != "cpu":
        # every block's saved tensors wait in host memory, one block comes back at a time
        host += int(flight * saved_blocks)
        activations -= int(flight * saved_blocks)
        before = s.saved if blocks > 1 else 0
    gathered_block = s.gathered_params * r.unit if fsdp > 1 else 0
    phases = {}
    if blocks:  # the last block's attention kernel in forward
        phases["attention_forward"] = (r.base + grads_live + before + embed + s.attn_part
                                       + s.forward_temp + gathered_block)  # fmt: skip
    if last:  # FSDP gathers the root (embedding, output) again only after the loss backward
        root = r.head_elems * r.unit if fsdp > 1 else 0
        phases["loss_backward"] = r.base - root + grads_live + activations + s.loss_temp
    if blocks:  # the last block's backward, its activations (recomputed) live again
        phases["block_backward"] = r.base + before + embed + _block_backward_extra(
            layout, job, s, r, last, grads_live
        )
    if fsdp > 1 and r.head_elems:  # the root's reduce-scatter ends the backward: its
        # gradients unsharded, flattened and cast for the collective, beside every shard
        phases["root_reduce_scatter"] = r.base + r.grads + r.head_elems * (r.unit + 2 * _FP32)
    # foreach AdamW keeps one parameter-sized temporary
    phases["optimizer_step"] = r.params + r.optimizer + r.buffers + r.grads + r.params
    # start-up: the shards, and one tensor drawn whole in fp32 beside this rank's block of it
    phases["startup"] = r.params + r.buffers + 2 * _FP32 * shape.largest_tensor()
    return MemoryEstimate(
        params=r.params, grads=r.grads, optimizer=r.optimizer, activations=activations,
        buffers=r.buffers, peak=max(phases.values()), host=host, phases=phases,
        startup=phases["startup"],
    )  # fmt: skip


def _block_backward_extra(layout, job, s: _Sizes, r: _Rank, last: bool, grads_live: int) -> int:
    """Gradients, the block's live activations and buffers, FSDP's and DDP's copies."""
    fsdp = layout.fsdp
    head_grad = (r.head_elems * r.unit if last else 0) if fsdp > 1 else 0
    if last and not grads_live:
        head_grad += _FP32 * ceil_div(r.head_elems, fsdp)
    extra = max(grads_live, head_grad) + max(s.backward_mlp, s.backward_attn)
    if fsdp > 1:  # the block and the next gathered, its unsharded gradients and their copy
        extra += 2 * s.gathered_params * r.unit + s.gathered_params * (r.unit + _FP32)
    elif layout.dp_replicate > 1:
        extra += s.layer_params * _FP32
    if layout.activation_offload and job.device == "cpu":
        extra += s.saved  # host copies are device memory: the block is held twice
    return extra


def _p2p_buffers(shape, layout, job, first, last, num_microbatches) -> int:
    """torch.distributed.pipelining's receive buffers: one per micro-batch, activations
    forward (not on the first stage) and gradients backward (not on the last)."""
    if layout.pp == 1:
        return 0
    tokens = layout.micro_batch * job.seq_len // layout.cp
    one = tokens * shape.hidden_size * job.element_size * num_microbatches * layout.virtual_stages
    return one * ((0 if first else 1) + (0 if last else 1))
