"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attention` blocks) as a token mixer
in place of `Attention`: same `forward(x, rope, position_ids, cu_seqlens, kv_cache=)`.

x -> in_proj_qkvz (q, k, v and the output gate z, grouped per key head as Qwen3-Next's
checkpoints hold them) and in_proj_ba (write strength b and decay input a per value head)
-> a short causal depthwise convolution over [q, k, v] with SiLU (its channels grouped per
key head too: each head's q, k, v; the adapter reorders Hugging Face's [all q, all k, all v])
-> the gated delta rule
(`mindspeed_ops.gated_delta_rule`: q, k L2-normalised, decay g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)) -> RMSNorm of each value head times silu(z)
-> out_proj. RoPE is not used.

Tensor parallel splits the key-head groups: in_proj_qkvz / in_proj_ba by column, the
convolution, dt_bias and A_log alike (`parallelize.py`), out_proj by row; the forward counts
its local heads from its weights.

Context parallel (whole rows, zig-zag chunks) passes the convolution's last inputs and the
recurrent state from chunk to chunk along the cp ranks (`mindspeed_core.parallel.chunk_scan`):
the projections run on each rank's own tokens, the recurrence chunk after chunk.

Packed documents (`cu_seqlens`) reset both the convolution and the recurrent state at each
document. Decoding keeps, per layer, the last (kernel - 1) convolution inputs and the
recurrent state in the `KVCache` (`LayerCache.state`); left-padding positions are zeroed
on the way in, so they leave both at zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from mindspeed_core.parallel import chunk_scan, dtensor
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import causal_conv1d, gated_delta_rule, gated_delta_rule_step

if TYPE_CHECKING:
    from mindspeed_llm.generation.kv_cache import LayerCache


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times weight, then times silu(gate) (fp32 inside)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight
        if isinstance(weight, DTensor):  # replicated under tp: each rank's heads, a partial grad
            weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
        out = weight * normed.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer of one block (see the module docstring)."""

    sliding_window = None  # read by `Transformer.forward` of every block's mixer

    def __init__(self, config: TransformerConfig, layer_id: int | None = None):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel = config.linear_conv_kernel_dim
        self.impl = config.ops_impl
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = Linear(config.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(config.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, 1, self.kernel))  # depthwise
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, bias=False)
        # Set by mindspeed_core's `apply_cp`: inputs are this rank's zig-zag sequence shards.
        self.context_parallel = None

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        for linear in (self.in_proj_qkvz, self.in_proj_ba):
            init.normal(linear.weight, std)
        init.normal(self.conv_weight, std)
        init.constant(self.dt_bias, 1.0)
        # decay rates A in [1, 16] as Qwen3-Next initialises them
        init.draw(self.A_log, lambda shape, g, device: torch.empty(shape, device=device)
                  .uniform_(1, 16, generator=g).log())  # fmt: skip
        init.constant(self.norm.weight, 1.0)
        init.normal(self.out_proj.weight, out_std)

    def forward(
        self,
        x: Tensor,
        rope: object = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        *,
        kv_cache: LayerCache | None = None,
    ) -> Tensor:
        batch, seq, _ = x.shape
        if kv_cache is not None and (mask := kv_cache.new_positions_mask(seq)) is not None:
            x = x * mask[..., None].to(x.dtype)  # left padding: no input, so no state
        ratio = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        per_head = 2 * dk + ratio * dv  # one key head's q, k and v channels
        qkvz = self.in_proj_qkvz(x).view(batch, seq, -1, per_head + ratio * dv)  # local heads
        heads = qkvz.shape[2]
        mixed, z = qkvz.split([per_head, ratio * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, seq, heads, -1).split(ratio, dim=-1)
        beta = b.reshape(batch, seq, -1).sigmoid()
        a_log, dt_bias = dtensor.local(self.A_log), dtensor.local(self.dt_bias)
        g = -a_log.float().exp() * F.softplus(a.reshape(batch, seq, -1).float() + dt_bias)
        mixed = mixed.reshape(batch, seq, -1)
        if self.context_parallel is not None and kv_cache is None:
            out = self._context_parallel(mixed, g, beta, heads, cu_seqlens)
            out = self.norm(out, z.reshape(batch, seq, -1, dv))
            return self.out_proj(out.reshape(batch, seq, -1))
        state = None if kv_cache is None else kv_cache.state
        conv_state, recurrent = (None, None) if state is None else state
        mixed, conv_state = self._conv(mixed, conv_state, cu_seqlens, keep=kv_cache is not None)
        q, k, v = mixed.view(batch, seq, heads, per_head).split([dk, dk, ratio * dv], dim=-1)
        v = v.reshape(batch, seq, heads * ratio, dv)
        if kv_cache is not None and seq == 1 and recurrent is not None:
            out, recurrent = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                                   recurrent)  # fmt: skip
            out = out[:, None]
        elif cu_seqlens is not None:  # packed documents over the flattened batch
            flat = (t.flatten(0, 1) for t in (q, k, v, g, beta))
            out, _ = gated_delta_rule(*flat, cu_seqlens=cu_seqlens, impl=self.impl)
            out = out.view(batch, seq, *out.shape[1:])
        else:
            out, recurrent = gated_delta_rule(
                q, k, v, g, beta, initial_state=recurrent, output_final_state=kv_cache is not None,
                impl=self.impl,
            )  # fmt: skip
        if kv_cache is not None:
            kv_cache.state = (conv_state, recurrent)
        out = self.norm(out, z.reshape(batch, seq, -1, dv))
        return self.out_proj(out.reshape(batch, seq, -1))

    def _context_parallel(self, mixed, g, beta, heads, cu_seqlens) -> Tensor:
        """Convolution and recurrence of this rank's two zig-zag chunks, each continuing the
        state of the chunk before it in the sequence (`chunk_scan` over the cp ranks)."""
        cp = self.context_parallel
        if cu_seqlens is not None:
            raise ValueError("gated DeltaNet under context parallel takes whole rows (data.pack "
                             "off), not packed documents")  # fmt: skip
        if cp.ring_group is not None and cp.ulysses_group is not None:
            raise ValueError("gated DeltaNet under context parallel needs cp_mode ring or ulysses")
        group = cp.ring_group if cp.ring_group is not None else cp.ulysses_group
        batch, dk, dv = mixed.shape[0], self.head_k_dim, self.head_v_dim
        ratio = self.num_v_heads // self.num_k_heads
        per_head = 2 * dk + ratio * dv

        def run(inputs, params, state):
            x, g_chunk, beta_chunk = inputs
            y, conv_state = self._conv(x, state[0], None, keep=True, weight=params[0])
            chunk = x.shape[1]
            q, k, v = y.view(batch, chunk, heads, per_head).split([dk, dk, ratio * dv], dim=-1)
            v = v.reshape(batch, chunk, heads * ratio, dv)
            out, final = gated_delta_rule(q, k, v, g_chunk, beta_chunk, initial_state=state[1],
                                          output_final_state=True, impl=self.impl)  # fmt: skip
            return [out], [conv_state, final.to(state[1].dtype)]

        init = [mixed.new_zeros(batch, self.kernel - 1, mixed.shape[-1]),
                mixed.new_zeros(batch, heads * ratio, dk, dv, dtype=torch.float32)]  # fmt: skip
        weight = dtensor.local(self.conv_weight)
        (out,) = chunk_scan(run, [mixed, g, beta], [weight], init, group)
        return out

    def _conv(self, x: Tensor, state: Tensor | None, cu_seqlens: Tensor | None, *, keep: bool,
              weight: Tensor | None = None):  # fmt: skip
        """Causal depthwise convolution of x (batch, seq, channels) with SiLU, continuing
        from `state` (batch, kernel - 1, channels) (None: zeros; `mindspeed_ops.causal_conv1d`) and restarting at every
        document of `cu_seqlens`; -> (y, the last kernel - 1 inputs if `keep`). `weight`:
        this rank's (channels, 1, kernel) weight, default the module's."""
        batch, seq, channels = x.shape
        conv_weight = dtensor.local(self.conv_weight) if weight is None else weight
        weight = conv_weight[:, 0]  # (channels, kernel): tap kernel - 1 reads x_t
        if cu_seqlens is not None:
            flat = x.reshape(-1, channels)
            tokens = torch.arange(flat.shape[0], device=x.device)
            doc = torch.searchsorted(cu_seqlens.to(tokens), tokens, right=True)
            y = flat * weight[:, -1]
            for j in range(1, self.kernel):  # x_{t-j} within the same document only
                shifted = F.pad(flat, (0, 0, j, 0))[: flat.shape[0]]
                same = F.pad(doc, (j, 0), value=-1)[: flat.shape[0]] == doc
                y = y + shifted * same[:, None].to(flat.dtype) * weight[:, -1 - j]
            return F.silu(y).view(batch, seq, channels), None
        y, new_state = causal_conv1d(x, weight.to(x.dtype), cache=state)
        return y, new_state if keep else None
