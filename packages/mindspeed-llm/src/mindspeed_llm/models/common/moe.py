"""Mixture of experts: a router, grouped experts, optional shared expert, and the MoE block.

The block replaces `FeedForward` in a `Block` (same `init_weights(init, std, out_std)` and
`forward(x)`). Tokens are routed to `top_k` experts, sorted by expert, run through one
grouped GEMM per projection (`mindspeed_ops.grouped_matmul`), then put back in place and
summed with their routing weights. Expert weights are stacked `(num_experts, in, out)`,
so expert parallel shards them on dim 0; `mindspeed_core.parallel.apply_ep` wraps
`GroupedExperts` with the all-to-all dispatch, the block itself does not change.

The auxiliary losses reach the trainer through a side channel that needs no change of
the model's return value (and so works with FSDP, recompute and pipeline stages): each
`MoE` keeps the `RouterStats` of its last forward in `last_stats`, and `moe_aux_loss(model)`
combines them right after the forward, before backward (`moe_stats.py`, with `LoadTracker`,
which accumulates the expert loads over a step for the metrics and for the aux-loss-free
bias update).

Under parallel layouts (set from outside by `parallelize.py`, the block's code is the same):
- tensor parallel: every tp rank routes the same (gathered) tokens through all its experts,
  so the statistics are already those of the tokens; nothing is reduced over tp;
- context parallel: each cp rank routes its share of a sequence; `token_group` names the
  cp ranks, and the load-balancing loss sums the expert loads over them first;
- pipeline parallel: a stage holds some of the layers, so the step cannot gather every
  layer's statistics after the forward; each block instead attaches its own share of the
  aux loss to its output (`attach_aux`, Megatron's auxiliary-loss scaler), whose backward
  adds that share's gradient. This needs `router_aux_loss_scope="layer"`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mindspeed_core.parallel import dtensor
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.feed_forward import FeedForward
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import grouped_matmul, swiglu


@dataclass
class RouterStats:
    """What one MoE layer's router saw in its last forward (over this rank's tokens)."""

    tokens_per_expert: Tensor
    """(num_experts,) float count of top-k assignments before capacity dropping (no grad)."""
    prob_per_expert: Tensor
    """(num_experts,) mean routing probability over tokens (differentiable)."""
    z_loss: Tensor
    """Scalar mean of logsumexp(router logits)^2 (differentiable)."""
    num_tokens: int
    num_dropped: int
    """Assignments dropped by the capacity limit."""


class Router(nn.Module):
    """Top-k routing: softmax (Mixtral/Qwen) or sigmoid (DeepSeek-V3) scores.

    With sigmoid scores a non-learned `expert_bias` buffer is added to the scores for
    choosing experts only (aux-loss-free balancing); `update_bias` moves it toward
    balance after each step. DeepSeek-V3 also limits each token to its `topk_groups` best
    groups of experts and scales the weights by `scaling`; DeepSeek-V2 limits softmax
    routing to groups scored by their best expert (`expert_group_score="max"`).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.score = config.router_score
        self.norm_topk_prob = config.norm_topk_prob
        self.num_groups, self.topk_groups = config.num_expert_groups, config.topk_expert_groups
        self.group_score = config.expert_group_score
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # gpt-oss: a learned bias on the logits (unlike DeepSeek's choice-only `expert_bias`)
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None
        if self.score == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def init_weights(self, init: ParamInit, std: float) -> None:
        init.normal(self.weight, std)
        init.constant(self.bias, 0.0)
        if self.score == "sigmoid":
            self.expert_bias.zero_()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (tokens, hidden) -> (indices (tokens, k), weights (tokens, k), probs, logits)."""
        logits = F.linear(x, self.weight, self.bias).float()  # (tokens, experts)
        if self.score == "softmax":
            scores = probs = torch.softmax(logits, dim=-1)
            _, indices = torch.topk(self._limit_groups(scores), self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
            choice = self._limit_groups(scores + self.expert_bias)
            _, indices = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return indices, weights.to(x.dtype), probs, logits

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Choice scores (tokens, experts) with every expert outside the token's
        `topk_groups` best groups set to -inf; a group's score is the sum of its two best
        ("top2_sum") or its best ("max")."""
        if self.num_groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # (tokens, groups, per group)
        if self.group_score == "max":
            group_scores = grouped.amax(dim=-1)  # (tokens, groups)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower the over-loaded ones by `rate`."""
        load = tokens_per_expert.to(self.expert_bias)
        self.expert_bias += rate * torch.sign(load.mean() - load)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights, run as grouped GEMMs.

    Input rows are sorted by expert; `num_tokens_per_expert` says how many each gets.
    Under expert parallel the weights are DTensors sharded on dim 0 and `apply_ep` hands
    this module only the rows (and counts) of its local experts.

    gpt-oss's experts also have biases (`bias=True`: b1, b3 (num_experts, intermediate)
    and b2 (num_experts, hidden), sharded like the weights) and a clamped activation
    (`swiglu_limit`, see `clamped_swiglu`).

    `adapters` (empty unless `mindspeed_llm.peft` fills it) maps a projection name (w1, w3,
    w2) to a module `adapter(x, out, counts) -> out'` that adds its update to that grouped
    matmul's output; its parameters stack the experts on dim 0 too, so expert parallel
    shards them alike.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        impl: str,
        *,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.impl = impl
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.b1 = self.b3 = self.b2 = None
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, intermediate_size))
            self.b3 = nn.Parameter(torch.empty(num_experts, intermediate_size))
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.adapters = nn.ModuleDict()

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        # One expert at a time: under expert parallel a rank draws only its own experts.
        init.normal(self.w1, std, per_row_block=True)
        init.normal(self.w3, std, per_row_block=True)
        init.normal(self.w2, out_std, per_row_block=True)
        for b in (self.b1, self.b3, self.b2):
            init.constant(b, 0.0)

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        # Under expert parallel without FSDP of the experts nothing casts their weights
        # to the compute dtype (bf16 runs), so do it here; a no-op otherwise.
        w1, w2, w3 = (dtensor.local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        counts = num_tokens_per_expert
        gate = grouped_matmul(x, w1, counts, impl=self.impl)
        up = grouped_matmul(x, w3, counts, impl=self.impl)
        expert = None
        if self.b1 is not None:  # each row's expert, to add that expert's biases
            expert = torch.repeat_interleave(
                torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0]
            )
            gate, up = gate + self._bias(self.b1, expert, x), up + self._bias(self.b3, expert, x)
        if self.adapters:
            gate, up = self._adapt("w1", x, gate, counts), self._adapt("w3", x, up, counts)
        if self.swiglu_limit is not None:
            hidden = clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)
        else:
            hidden = swiglu(gate, up, impl=self.impl)
        out = self._adapt("w2", hidden, grouped_matmul(hidden, w2, counts, impl=self.impl), counts)
        return out if expert is None else out + self._bias(self.b2, expert, x)

    def _adapt(self, name: str, x: Tensor, out: Tensor, counts: Tensor) -> Tensor:
        """`out` (the rows of `x` through projection `name`) plus its adapter's update."""
        return self.adapters[name](x, out, counts) if name in self.adapters else out

    @staticmethod
    def _bias(bias: Tensor, expert: Tensor, x: Tensor) -> Tensor:
        return dtensor.local(bias).to(x.dtype)[expert]


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float, alpha: float) -> Tensor:
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    with g = clamp(gate, max=limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


class MoE(nn.Module):
    """Router -> sort by expert -> grouped experts -> weighted sum (+ gated shared expert).

    Attributes set by the parallel layout (None / False by default):
        token_group: the context-parallel ranks that route shares of the same sequences;
            the load-balancing loss sums expert loads over them.
        attach_aux: pipeline parallel: attach this layer's share of the aux loss to the
            output (see `AttachAux`), scaled by `aux_grad_scale` (the micro-batch's share
            of the step, set by the trainer before each schedule step).
        accumulate_stats: pipeline parallel: add each training forward's statistics to
            the `step_stats` buffer (`LoadTracker` reads and clears it). A buffer, because
            torch's pipelining runs a real forward to infer shapes and then restores
            buffers, so that forward leaves no trace.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef = config.router_aux_loss_coef
        self.z_loss_coef = config.router_z_loss_coef
        self.num_moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        self.token_group: dist.ProcessGroup | None = None
        self.attach_aux = False
        self.aux_grad_scale = 1.0
        self.last_aux: Tensor | None = None
        self.accumulate_stats = False
        # (num_experts loads, dropped, forwards, aux sum) of the step so far
        self.register_buffer("step_stats", torch.zeros(self.num_experts + 3), persistent=False)
        self.router = Router(config)
        self.experts = GroupedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size,
            config.ops_impl, bias=config.expert_bias, swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
        )  # fmt: skip
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = FeedForward(
                config.hidden_size, config.shared_expert_intermediate_size, impl=config.ops_impl
            )
            if config.shared_expert_gated:
                self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.last_stats: RouterStats | None = None

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        self.step_stats.zero_()
        self.router.init_weights(init, std)
        self.experts.init_weights(init, std, out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init, std, out_std)
        if self.shared_expert_gate is not None:
            init.normal(self.shared_expert_gate.weight, std)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, hidden)
        indices, weights, probs, logits = self.router(x)
        flat = indices.flatten()  # (tokens * k,) token-major
        counts_all = _expert_counts(flat, self.num_experts)
        num_dropped = 0
        if self.capacity_factor is not None:
            flat, num_dropped = self._drop_over_capacity(flat, x.shape[0])
        # Dropped assignments carry the id num_experts, so they sort last and are cut off.
        order = torch.argsort(flat, stable=True)
        counts = _expert_counts(flat, self.num_experts + 1)[: self.num_experts]
        kept = order[: flat.numel() - num_dropped] if num_dropped else order
        routed = self.experts(x[kept // self.top_k], counts)  # (kept, hidden)
        out = x.new_zeros(flat.numel(), shape[-1]).index_copy(0, kept, routed)
        out = (out.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:  # DeepSeek: shared experts without a gate
            out = out + self.shared_expert(x)
        self.last_stats = RouterStats(
            tokens_per_expert=counts_all.detach().float(),
            prob_per_expert=probs.mean(dim=0),
            z_loss=torch.logsumexp(logits, dim=-1).square().mean(),
            num_tokens=x.shape[0],
            num_dropped=num_dropped,
        )
        if self.attach_aux:
            out = self._attach_aux(out)
        if self.accumulate_stats and torch.is_grad_enabled() and not _in_backward():
            self._accumulate()
        return out.view(shape)

    @torch.no_grad()
    def _accumulate(self) -> None:
        """Add the last forward's statistics to `step_stats` (recompute in backward and
        forwards without autograd are not counted)."""
        stats, aux = self.last_stats, self.last_aux
        self.step_stats[: self.num_experts] += stats.tokens_per_expert.to(self.step_stats)
        self.step_stats[self.num_experts :] += self.step_stats.new_tensor([stats.num_dropped, 1, 0])
        if aux is not None:
            self.step_stats[-1] += aux.to(self.step_stats)

    def _attach_aux(self, out: Tensor) -> Tensor:
        """`out` carrying this layer's share of the model's aux loss into backward."""
        aux = layer_aux_loss(self.last_stats, self) / self.num_moe_layers
        self.last_aux = aux.detach()
        no_coef = not (self.aux_loss_coef or self.z_loss_coef)
        if no_coef or not aux.requires_grad:  # or a forward without autograd (evaluation)
            return out
        return AttachAux.apply(out, aux * self.aux_grad_scale)

    def _drop_over_capacity(self, flat: Tensor, num_tokens: int) -> tuple[Tensor, int]:
        """Keep the first `capacity` assignments of each expert (in token order)."""
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        one_hot = F.one_hot(flat, self.num_experts)  # (assignments, experts)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
        keep = position < capacity
        return torch.where(keep, flat, self.num_experts), int((~keep).sum())


def _expert_counts(flat: Tensor, num_experts: int) -> Tensor:
    """(num_experts,) assignments per expert id: `bincount(flat, minlength=num_experts)`
    for ids below num_experts, with a shape torch.compile knows before it runs (bincount's
    depends on the largest id)."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class AttachAux(torch.autograd.Function):
    """Returns `out` unchanged; backward also gives `aux` the gradient 1, as if `aux`
    had been added to the loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def load_balancing_loss(
    stats: list[RouterStats], num_experts: int, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Switch Transformer's loss as Hugging Face's `load_balancing_loss_func` computes it.

    num_experts * sum_e f_e * P_e, where f_e is the fraction of top-k assignments to
    expert e and P_e its mean routing probability, both averaged over the layers first.

    With `group` (context parallel: ranks holding shares of the same sequences) f_e is
    that of the whole sequences (counts summed over the group), P_e stays this rank's
    mean. The group's ranks average their gradients, and the mean of P_e over equal
    shares is the whole sequences' P_e, so the averaged gradient and the mean value over
    the group are the whole sequences' loss.
    """
    rows = sum(s.num_tokens for s in stats)
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(0)
    total = torch.cat([counts, counts.new_tensor([rows])])
    if group is not None:
        dist.all_reduce(total, group=group)
    tokens = total[:-1] / total[-1]
    probs = torch.stack([s.prob_per_expert * s.num_tokens for s in stats]).sum(0) / rows
    return num_experts * (tokens * probs).sum()


def layer_aux_loss(stats: RouterStats, layer: MoE) -> Tensor:
    """One layer's weighted aux loss: its own load balancing and z-loss."""
    loss = stats.z_loss * layer.z_loss_coef
    if layer.aux_loss_coef:
        balance = load_balancing_loss([stats], layer.num_experts, layer.token_group)
        loss = loss + layer.aux_loss_coef * balance
    return loss


def _in_backward() -> bool:
    """Whether autograd is running a backward (where recompute re-runs forwards)."""
    return torch._C._current_graph_task_id() != -1
