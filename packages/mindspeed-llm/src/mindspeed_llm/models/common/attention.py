"""Causal self-attention: GQA, optional q/k/v (and o) biases, qk RMSNorm (per head or over
all heads), sliding window, soft-capped scores, attention sinks, packed documents, context
parallel.

The forward uses local head counts (``view(batch, seq, -1, head_dim)``), so the same module
runs whole or with wq/wk/wv split by column and wo by row under tensor parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mindspeed_core.parallel import dtensor
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.linear import Linear, joint_projection, project_together
from mindspeed_llm.models.common.norm import RMSNorm, rms_norm_over_ranks
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import attention, rotary_embedding

if TYPE_CHECKING:
    from mindspeed_llm.generation.kv_cache import LayerCache

RopeTables = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class SharedKeys:
    """Packed documents whose queries attend to keys gathered from across the row: a reply
    sharing its prompt with other replies (DPO's chosen and rejected) is a document of its own
    whose keys are the prompt's tokens and its own, so the prompt's forward and backward run
    once. Given as a model's `cu_seqlens` (with explicit `position_ids`: a reply's continue
    its prompt's).

    cu_seqlens: the queries' documents over the flattened batch * seq tokens;
    index: (key tokens,) the flat token each key and value is taken from;
    cu_seqlens_k: the keys' documents over `index` (as many as cu_seqlens);
    offsets: per document, how far its queries sit after its keys' start (the prompt's
        length; 0 for a prompt or a document on its own).
    """

    cu_seqlens: Tensor
    index: Tensor
    cu_seqlens_k: Tensor
    offsets: Tensor


class Attention(nn.Module):
    """Multi-head attention with `num_kv_heads` key/value heads shared by query groups."""

    def __init__(self, config: TransformerConfig, layer_id: int | None = None):
        super().__init__()
        self.head_dim = config.head_dim
        full = layer_id is not None and layer_id in config.full_attention_layers
        self.sliding_window = None if full else config.sliding_window
        scalar = config.query_pre_attn_scalar
        self.scale = None if scalar is None else scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        self.impl = config.ops_impl
        # Set by mindspeed_core's `apply_cp`: inputs are this rank's zig-zag sequence shards.
        self.context_parallel = None
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # Qwen3-Next: wq's rows are [q, gate] per head; the output passes sigmoid(gate).
        self.output_gate = config.attention_output_gate
        q_rows = 2 * q_dim if self.output_gate else q_dim
        self.wq = Linear(config.hidden_size, q_rows, bias=config.qkv_bias)
        self.wk = Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wv = Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wo = Linear(q_dim, config.hidden_size, bias=config.attention_out_bias)
        # gpt-oss: one logit per query head in each row's softmax denominator. Under tensor
        # parallel a DTensor sharded by head like wq's rows (`parallelize.py`).
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None
        # MiniMax-M2 normalises the whole q and k projections, Qwen3 each head.
        self.qk_norm_all = config.qk_norm_scope == "all"
        # Set by `parallelize_decoder` under tensor parallel with qk_norm_scope="all": the
        # tp ranks whose shares of q and k make up the width one norm spans.
        self.qk_norm_group: dist.ProcessGroup | None = None
        if config.qk_norm:
            offset = config.norm_unit_offset
            q_width, k_width = (q_dim, kv_dim) if self.qk_norm_all else (config.head_dim,) * 2
            self.q_norm = RMSNorm(q_width, config.norm_eps, impl=self.impl, offset=offset)
            self.k_norm = RMSNorm(k_width, config.norm_eps, impl=self.impl, offset=offset)
        else:
            self.q_norm = self.k_norm = None

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.normal(linear.weight, std)
            init.constant(linear.bias, 0.0)
        init.normal(self.wo.weight, out_std)
        init.constant(self.wo.bias, 0.0)
        init.normal(self.sinks, std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_params(init)

    def _norm_all_heads(self, norm: RMSNorm, x: Tensor) -> Tensor:
        if self.qk_norm_group is None:
            return norm(x)
        return rms_norm_over_ranks(x, norm, self.qk_norm_group)

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        *,
        kv_cache: LayerCache | None = None,
    ) -> Tensor:
        """
        Args:
            x: (batch, seq, hidden).
            rope: (cos, sin) tables from `rope_tables`.
            position_ids: (batch, seq) or (seq,) RoPE positions; default 0..seq-1.
            cu_seqlens: int32 (num_docs + 1,) boundaries of documents packed over the
                flattened batch * seq tokens; attention never crosses them.
            kv_cache: generation only: this layer's slice of a `KVCache`; the new keys and
                values are written at its offset and the queries attend to everything
                cached so far (its mask hides left padding).
        """
        shared = cu_seqlens if isinstance(cu_seqlens, SharedKeys) else None
        if shared is not None:
            cu_seqlens = shared.cu_seqlens
        batch, seq, _ = x.shape
        gate = None
        q, k, v = self._rotated_qkv(x, rope, position_ids)
        if q is None:  # the projections one by one, or norms or a gate between them and RoPE
            q, k, v = project_together(x, (self.wq, self.wk, self.wv))
            if self.output_gate:  # Qwen3-Next: wq's rows are each head's q, then its gate
                q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
                q, gate = q.reshape(batch, seq, -1), gate.reshape(batch, seq, -1)
            if self.q_norm is not None and self.qk_norm_all:  # MiniMax-M2: over all heads
                q, k = self._norm_all_heads(self.q_norm, q), self._norm_all_heads(self.k_norm, k)
            q = q.view(batch, seq, -1, self.head_dim)  # (batch, seq, local heads, head_dim)
            k = k.view(batch, seq, -1, self.head_dim)
            v = v.view(batch, seq, -1, self.head_dim)
            if self.q_norm is not None and not self.qk_norm_all:  # Qwen3: per head, before RoPE
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rope
            q = rotary_embedding(q, cos, sin, position_ids, impl=self.impl)
            k = rotary_embedding(k, cos, sin, position_ids, impl=self.impl)
        # Gemma 2's own score scale and soft cap (None: 1/sqrt(head_dim), no cap).
        options = dict(window=self.sliding_window, scale=self.scale, softcap=self.softcap)
        if self.sinks is not None:  # this rank's heads' sinks
            options["sinks"] = dtensor.local(self.sinks)
        if kv_cache is not None:
            out = kv_cache.attend(q, k, v, **options)
            return self._output(out.reshape(batch, seq, -1), gate)
        if cu_seqlens is not None:  # packed layout: (batch * seq, heads, head_dim)
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        if shared is not None:  # each document's keys: its prompt's and its own
            if self.context_parallel is not None:
                raise ValueError("shared prompts (SharedKeys) do not run under context parallel")
            k, v = k.index_select(0, shared.index), v.index_select(0, shared.index)
            options.update(cu_seqlens_k=shared.cu_seqlens_k, offsets=shared.offsets)
        if self.context_parallel is not None:
            out = self.context_parallel(q, k, v, cu_seqlens=cu_seqlens, **options)
        else:
            out = attention(q, k, v, cu_seqlens=cu_seqlens, impl=self.impl, **options)
        return self._output(out.reshape(batch, seq, -1), gate)

    def _rotated_qkv(self, x: Tensor, rope: RopeTables, position_ids: Tensor | None):
        """(q, k, v) as (batch, seq, local heads, head_dim), q and k rotated, from one matmul
        (`joint_projection`) and one RoPE call over q's and k's heads side by side: half the
        RoPE ops of the eager path. (None, None, None) where a gate or q/k norms sit between
        the projections and RoPE, or the projections do not run as one."""
        if self.output_gate or self.q_norm is not None:
            return None, None, None
        qkv = joint_projection(x, (self.wq, self.wk, self.wv))
        if qkv is None:
            return None, None, None
        batch, seq, _ = x.shape
        q_heads, kv_heads = self.wq.out_features // self.head_dim, self.wk.out_features // self.head_dim
        qk, v = qkv.split([self.wq.out_features + self.wk.out_features, self.wv.out_features], -1)
        qk = qk.view(batch, seq, q_heads + kv_heads, self.head_dim)
        qk = rotary_embedding(qk, *rope, position_ids, impl=self.impl)
        q, k = qk.split([q_heads, kv_heads], dim=2)
        return q, k, v.view(batch, seq, kv_heads, self.head_dim)

    def _output(self, out: Tensor, gate: Tensor | None) -> Tensor:
        return self.wo(out if gate is None else out * torch.sigmoid(gate))
