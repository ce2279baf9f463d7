"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values expanded from a
small per-token latent, with RoPE on a few decoupled channels.

Per token (h: hidden state):

- queries: `wq(h)`, or low rank `wq_b(q_norm(wq_a(h)))` when `q_lora_rank` is set, split
  per head into qk_nope_head_dim channels without RoPE and qk_rope_head_dim with it;
- `wkv_a(h)` gives the latent (kv_lora_rank) and one rotary key head (qk_rope_head_dim)
  shared by every head; `wkv_b(kv_norm(latent))` expands the latent into each head's
  non-rotary key and its value (v_head_dim);
- scores use head_dim = qk_nope + qk_rope channels, scaled by head_dim ** -0.5 (times
  YaRN's mscale(factor, mscale_all_dim) ** 2 when RoPE is YaRN with mscale_all_dim).

The attention op takes values narrower than keys (v_head_dim < head_dim: 128 vs 192 for
DeepSeek-V3), so training runs no padding on CPU (our flash kernel) and pads inside the kernel
only where a fused kernel needs one width (CUDA flash). The KV cache keeps one width: values are
zero-padded there and the padding is cut from the output (exact). Caching the latent instead
(the memory win of MLA at inference) is left for later.

The latent norms use epsilon 1e-6 whatever `norm_eps` is, as DeepSeek's checkpoints were
trained with (transformers builds them with the default too).

DeepSeek Sparse Attention (DeepSeek-V3.2, `index_topk` > 0): a lightning `Indexer` scores
every visible key for each query, sum_h w_h relu(q_h . k * d^-0.5) over its own small
heads (from the low-rank query and the hidden state, no gradient from the main loss), and
the query attends to its `index_topk` best keys only (`sparse_attention`: the selected keys
gathered, O(tokens x index_topk) memory). A query that sees no more keys than that attends
densely, as before. The indexer learns from its own KL loss (`index_loss_scale`), attached
to the block's output so that its gradient reaches the indexer alone. Decoding keeps the
indexer's keys in the KV cache and masks the cached keys to the selected ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from mindspeed_core.parallel import dtensor
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.common.moe import AttachAux
from mindspeed_llm.models.common.norm import RMSNorm
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import attention, rotary_embedding
from mindspeed_ops.validate import host_values

if TYPE_CHECKING:
    from mindspeed_llm.generation.kv_cache import LayerCache

RopeTables = tuple[Tensor, Tensor]
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: TransformerConfig) -> float:
    """head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when set."""
    scale = config.head_dim**-0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling["type"] == "yarn" and scaling.get("mscale_all_dim"):
        factor = scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def _local_share(t: Tensor) -> Tensor:
    """A replicated DTensor (tensor parallel) as this rank's plain tensor, for use with its
    local heads only: its gradient is marked partial, so DTensor sums it over the ranks."""
    if isinstance(t, DTensor):
        return t.to_local(grad_placements=[Partial()] * t.device_mesh.ndim)
    return t


class Indexer(nn.Module):
    """DSA's lightning indexer: which keys each query attends to (see the module docstring).

    Under tensor parallel its weights are replicated DTensors (`parallelize.py`) that every
    rank runs whole on the gathered input: the same choice everywhere, and the same gradient
    (its KL loss sums the attention target over the ranks' heads), so they are used as
    replicated local tensors."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.impl = config.ops_impl
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False)

    def init_weights(self, init: ParamInit, std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init.normal(linear.weight, std)
        init.constant(self.k_norm.weight, 1.0)
        init.constant(self.k_norm.bias, 0.0)

    def _rotate(self, t: Tensor, rope: RopeTables, position_ids: Tensor | None) -> Tensor:
        rot, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = rotary_embedding(rot, *rope, position_ids, impl=self.impl)  # rotate-half pairs
        return torch.cat([rot, rest], dim=-1)

    def queries(self, x: Tensor, q_resid: Tensor, rope: RopeTables, position_ids) -> tuple:
        """(q (batch, seq, heads, d), head weights (batch, seq, heads)) of the indexer."""
        batch, seq, _ = x.shape
        q = F.linear(q_resid, dtensor.local(self.wq_b.weight))
        q = q.view(batch, seq, self.n_heads, self.head_dim)
        weights = F.linear(x, dtensor.local(self.weights_proj.weight)).float() * self.n_heads**-0.5
        return self._rotate(q, rope, position_ids), weights

    def keys(self, x: Tensor, rope: RopeTables, position_ids) -> Tensor:
        """(batch, seq, d) indexer keys."""
        norm = self.k_norm
        k = F.layer_norm(F.linear(x, dtensor.local(self.wk.weight)), norm.normalized_shape,
                         dtensor.local(norm.weight), dtensor.local(norm.bias), norm.eps)  # fmt: skip
        k = k[:, :, None]
        return self._rotate(k, rope, position_ids)[:, :, 0]

    def scores(self, q: Tensor, weights: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """fp32 (batch, seq, keys) index scores, -inf where `allowed` (bool, broadcastable)
        hides a key."""
        dots = torch.einsum("bshd,btd->bsht", q.float(), keys.float()) * self.head_dim**-0.5
        scores = torch.einsum("bsh,bsht->bst", weights, F.relu(dots))
        return scores.masked_fill(~allowed, float("-inf"))


def select_keys(scores: Tensor, allowed: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """(index (batch, seq, k) long, valid (batch, seq, k) bool): each query's `topk` best
    keys by `scores`, k = min(topk, keys); an entry is valid where the key is allowed (a
    query that sees fewer keys than k gets some invalid ones). Equal scores (relu zeroes
    many) go to the earlier key, so a document packed after others picks the keys it picks
    alone (topk's order among ties is unspecified)."""
    k = min(topk, scores.shape[-1])
    index = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    valid = allowed.expand_as(scores).gather(-1, index)
    return index, valid


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor,
                     scale: float) -> Tensor:  # fmt: skip
    """Each query over its selected keys only: q (batch, seq, heads, d), k (batch, keys,
    heads, d), v (batch, keys, heads, dv), index / valid (batch, seq, k) from `select_keys`
    -> (batch, seq, heads, dv). Gathers the selected keys (plain PyTorch, fp32 softmax)."""
    batch, seq, top = index.shape
    rows = torch.arange(batch, device=q.device)[:, None, None]
    keys, values = k[rows, index], v[rows, index]  # (batch, seq, k, heads, d)
    scores = torch.einsum("bshd,bskhd->bshk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bshk,bskhd->bshd", probs, values.float()).to(q.dtype)


def index_kl_loss(q: Tensor, k: Tensor, scale: float, index_scores: Tensor, index: Tensor,
                  valid: Tensor, tp_group=None) -> Tensor:  # fmt: skip
    """DeepSeek's indexer loss: KL(p || softmax(index scores)) over each query's selected
    keys, p the main attention's distribution averaged over heads (no gradient), the mean
    over queries. Under tensor parallel (`tp_group`) q and k hold this rank's heads and the
    head sum runs over the group."""
    with torch.no_grad():
        batch = index.shape[0]
        rows = torch.arange(batch, device=q.device)[:, None, None]
        scores = torch.einsum("bshd,bskhd->bshk", q.float(), k[rows, index].float()) * scale
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        target = torch.softmax(scores, dim=-1).nan_to_num(0.0).sum(dim=2)  # (batch, seq, k)
        heads = q.shape[2]
        if tp_group is not None:
            dist.all_reduce(target, group=tp_group)
            heads *= dist.get_world_size(tp_group)
        target = target / heads
    chosen = index_scores.gather(-1, index).masked_fill(~valid, float("-inf"))
    log_q = torch.log_softmax(chosen, dim=-1)
    terms = torch.where(valid, target * (target.clamp_min(1e-30).log() - log_q), 0.0)
    return terms.sum(-1).mean()


class MultiLatentAttention(nn.Module):
    """MLA with `num_heads` heads; same `forward` signature as `Attention`.

    Under tensor parallel (`mla_tp_plan`) the heads are split: wq / wq_b and wkv_b by
    column (each rank's heads), wo by row; the low-rank parts (wq_a, q_norm, wkv_a,
    kv_norm) are replicated DTensors run on the gathered input, so their gradients come
    back whole through the column-parallel layers, and the shared rotary key, used by each
    rank's heads alone, is handed over as a partial-gradient share (`_local_share`)."""

    def __init__(self, config: TransformerConfig, layer_id: int | None = None):
        super().__init__()
        self.head_dim = config.head_dim
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.interleaved = config.rope_interleaved
        self.scale = softmax_scale(config)
        self.impl = config.ops_impl
        self.sliding_window = None  # read by the decoder (Gemma 3's local RoPE choice)
        # Set by mindspeed_core's `apply_cp`: inputs are this rank's zig-zag sequence shards.
        self.context_parallel = None
        hidden, heads = config.hidden_size, config.num_heads
        if config.q_lora_rank is None:
            self.wq = Linear(hidden, heads * self.head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = Linear(hidden, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, impl=self.impl)
            self.wq_b = Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        self.wkv_a = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, impl=self.impl)
        self.wkv_b = Linear(
            self.kv_lora_rank, heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.wo = Linear(heads * self.v_head_dim, hidden, bias=False)
        self.indexer = Indexer(config) if config.index_topk else None
        self.index_loss_scale = config.index_loss_scale
        # Set by `parallelize_decoder` under tensor parallel: the ranks that split the heads
        # (the indexer's KL target averages over all of them).
        self.tp_group = None
        self.last_index_loss: Tensor | None = None  # the last training forward's, detached
        # The micro-batch's share of the step (times the fp16 loss scale), set by the
        # trainer before each step; the indexer loss's gradient is scaled by it.
        self.aux_grad_scale = 1.0

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        if self.indexer is not None:
            self.indexer.init_weights(init, std)
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                init.normal(linear.weight, std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.init_params(init)
        init.normal(self.wo.weight, out_std)

    def kv_cache_layout(self) -> tuple[int, int, torch.dtype, torch.device]:
        """(cached heads, channels per cached key/value, dtype, device) for `KVCache`:
        every head's full key, and its value padded to the key's width."""
        weight = dtensor.local(self.wkv_b.weight)
        heads = weight.shape[0] // (self.nope_dim + self.v_head_dim)
        return heads, self.head_dim, weight.dtype, weight.device

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        *,
        kv_cache: LayerCache | None = None,
    ) -> Tensor:
        """Same arguments as `Attention.forward`; x (batch, seq, hidden) -> same shape."""
        batch, seq, _ = x.shape
        q = self._queries(x, rope, position_ids)  # (batch, seq, heads, head_dim)
        k, v = self._keys_values(x, rope, position_ids)  # v: (batch, seq, heads, v_head_dim)
        if self.indexer is not None:
            out = self._sparse(x, q, k, v, rope, position_ids, cu_seqlens, kv_cache)
            if out is not None:
                return self.wo(out.reshape(batch, seq, -1))
        if kv_cache is not None:  # the cache holds values zero-padded to the keys' width
            v = F.pad(v, (0, self.head_dim - self.v_head_dim))
            out = kv_cache.attend(q, k, v, scale=self.scale)[..., : self.v_head_dim]
        elif self.context_parallel is not None:
            if cu_seqlens is not None:  # packed local documents: (tokens, heads, head_dim)
                q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            out = self.context_parallel(q, k, v, cu_seqlens=cu_seqlens, scale=self.scale)
        elif cu_seqlens is None:
            out = attention(q, k, v, scale=self.scale, impl=self.impl)
        else:  # packed layout: (batch * seq, heads, head_dim)
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            out = attention(q, k, v, cu_seqlens=cu_seqlens, scale=self.scale, impl=self.impl)
        return self.wo(out.reshape(batch, seq, -1))

    def _sparse(self, x, q, k, v, rope, position_ids, cu_seqlens, kv_cache) -> Tensor | None:
        """DSA: the output over each query's selected keys, or None where every query sees
        at most index_topk keys (then dense attention is the same and runs instead)."""
        if self.context_parallel is not None:
            raise NotImplementedError("DeepSeek sparse attention under context parallel")
        indexer = self.indexer
        learn = self.training and self.index_loss_scale > 0 and kv_cache is None
        with torch.set_grad_enabled(learn and torch.is_grad_enabled()):
            # the indexer reads detached inputs: the main loss never trains it, nor it the rest
            x_in = x.detach()
            q_resid = dtensor.local(self.q_norm(self.wq_a(x_in))).detach()
            x_in = dtensor.local(x_in)
            iq, weights = indexer.queries(x_in, q_resid, rope, position_ids)
            keys = indexer.keys(x_in, rope, position_ids)
        if kv_cache is not None:
            return self._sparse_cached(q, k, v, iq, weights, keys, kv_cache)
        if cu_seqlens is not None:  # packed documents: one row, attention inside each
            q, k, v, iq, weights, keys = (t.flatten(0, 1)[None] for t in (q, k, v, iq, weights, keys))
        if _most_keys(q.shape[1], cu_seqlens) <= indexer.topk:
            return None
        allowed = _visible(q.shape[1], cu_seqlens, q.device)  # (1, seq, seq)
        with torch.set_grad_enabled(learn and torch.is_grad_enabled()):
            scores = indexer.scores(iq, weights, keys, allowed)
        index, valid = select_keys(scores.detach(), allowed, indexer.topk)
        out = sparse_attention(q, k, v, index, valid, self.scale)
        if learn:
            loss = index_kl_loss(q.detach(), k.detach(), self.scale, scores, index, valid,
                                 self.tp_group)  # fmt: skip
            self.last_index_loss = loss.detach()
            out = AttachAux.apply(out, loss * (self.index_loss_scale * self.aux_grad_scale))
        return out.view(x.shape[0], x.shape[1], *out.shape[2:])

    def _sparse_cached(self, q, k, v, iq, weights, keys, kv_cache) -> Tensor | None:
        """Decoding with DSA: the indexer's keys join the cache; the cached keys each query
        does not select are masked."""
        seq = q.shape[1]
        all_keys = kv_cache.index_keys(keys)  # (batch, end, d) up to these tokens
        allowed = kv_cache.visible(seq)  # (batch or 1, seq, end)
        v = F.pad(v, (0, self.head_dim - self.v_head_dim))
        if int(allowed.sum(-1).max()) <= self.indexer.topk:
            return kv_cache.attend(q, k, v, scale=self.scale)[..., : self.v_head_dim]
        scores = self.indexer.scores(iq, weights, all_keys, allowed)
        index, valid = select_keys(scores, allowed, self.indexer.topk)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, valid)
        out = kv_cache.attend(q, k, v, scale=self.scale, select=chosen)
        return out[..., : self.v_head_dim]

    def _rotate(self, t: Tensor, rope: RopeTables, position_ids: Tensor | None) -> Tensor:
        cos, sin = rope
        return rotary_embedding(
            t, cos, sin, position_ids, interleaved=self.interleaved, impl=self.impl
        )

    def _queries(self, x: Tensor, rope: RopeTables, position_ids: Tensor | None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, self.head_dim)  # (batch, seq, local heads, head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat([q_nope, self._rotate(q_rope, rope, position_ids)], dim=-1)

    def _keys_values(
        self, x: Tensor, rope: RopeTables, position_ids: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        batch, seq, _ = x.shape
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = _local_share(k_rope)[:, :, None, :]  # (batch, seq, 1, rope)
        k_rope = self._rotate(k_rope, rope, position_ids)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)  # per local head
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k, v  # the attention op takes values narrower than keys: no padding


def _visible(tokens: int, cu_seqlens: Tensor | None, device) -> Tensor:
    """(1, tokens, tokens) bool: causal, and inside one document when packed."""
    i = torch.arange(tokens, device=device)
    allowed = i[None, :] <= i[:, None]
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.to(i), i, right=True)
        allowed = allowed & (doc[None, :] == doc[:, None])
    return allowed[None]


def _most_keys(seq: int, cu_seqlens: Tensor | None) -> int:
    """The most keys a query sees: its (longest) document's length, known on the host without
    a device read (`host_values`). Under torch.compile the row's length, a constant: the
    sparse path then runs for short documents too, and selects every key they have."""
    if cu_seqlens is None or torch.compiler.is_compiling():
        return seq
    bounds = host_values(cu_seqlens)
    return max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
