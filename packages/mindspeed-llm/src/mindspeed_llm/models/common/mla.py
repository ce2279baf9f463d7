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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from mindspeed_core.parallel import dtensor
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.common.norm import RMSNorm
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import attention, rotary_embedding

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

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.normal_(linear.weight, std=std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
        nn.init.normal_(self.wo.weight, std=out_std)

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
