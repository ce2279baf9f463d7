"""Multi-token prediction (DeepSeek-V3): extra modules that predict tokens further ahead.

Module k (1-based, `config.num_nextn_predict_layers` of them, in sequence) sees, at
position i, the previous depth's hidden state h^(k-1)_i (h^0: the decoder's final-norm
output, as DeepSeek's checkpoints are used by vLLM) and the embedding of token t_(i+k):

    h'_i = eh_proj([enorm(embed(t_(i+k))); hnorm(h^(k-1)_i)])
    h^k  = block(h')                 (a decoder block, causal over positions)
    logits^k_i = output(norm(h^k_i)) (the decoder's embedding and output are shared)

and predicts token t_(i+1+k). The training loss adds mtp_loss_scale x the mean over
modules of each module's mean cross-entropy (`mtp_loss`). In packed documents depth k at
position i is supervised by labels[i + k] only when position i + k is in the same
document (as the main loss, its last position's label may be the next document's first
token); the MTP blocks attend within documents, so the embeddings shifted across a
boundary reach no supervised position.

In training the decoder computes the loss inside its forward (`Transformer.forward(...,
mtp_labels=labels)`, so FSDP has the shared embedding and head gathered) and keeps it in
`last_mtp_loss`; the step adds `take_mtp_loss(model)` to the objective, as it adds the MoE
router losses.

Under tensor parallel the MTP blocks are planned as the decoder's blocks and the rest of a
module runs whole on every rank (`parallelize`; under sequence parallel its norms and
eh_proj on sequence shards). Under context parallel (`cp_group` set)
the token k ahead of a position may sit on another rank: the ranks all-gather their
token ids and labels (ints, cheap), each looks its positions' k-ahead values up in the
zig-zag layout (`_ahead_over_cp`), and the counts are summed over the group. Each rank's
loss is cp x its share's nll / the whole count, so the mean over the group (the step's
metric, FSDP's gradient average over dp x cp) is one process's loss, as MoE's
load-balancing loss does under cp.

Under pipeline parallel the modules sit on the last stage. The first stage computes the
embeddings of the tokens ahead (`ahead_embeddings`) and they ride to the last stage
beside the hidden states, so the modules use the first stage's embedding itself: no copy
to keep equal (Megatron sends the token ids and all-reduces a copy's gradient), at the
cost of depths x hidden more per stage boundary. The last stage attaches its loss to its
output (`moe.AttachAux`, times `aux_grad_scale`, the step's share per microbatch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mindspeed_core.parallel.dtensor import full
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.config import TransformerConfig

IGNORE_INDEX = -100


class MTPLayer(nn.Module):
    """One prediction depth: its two input norms, the merge projection, a decoder block
    (numbered `layer_id`, after the decoder's) and its own final norm."""

    def __init__(self, layer_id: int, config: TransformerConfig, block: nn.Module, norm):
        super().__init__()
        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = block

    def init_weights(self, init: ParamInit, std: float) -> None:
        for n in (self.enorm, self.hnorm, self.norm):
            n.init_params(init)
        init.normal(self.eh_proj.weight, std)
        self.block.init_weights(init, std)

    def forward(
        self,
        embedded: Tensor,
        hidden: Tensor,
        rope,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """embedded: (batch, seq, hidden) embeddings of the tokens k ahead; hidden: the
        previous depth's (batch, seq, hidden) -> this depth's (batch, seq, hidden), pre-norm."""
        merged = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(merged, rope, position_ids=position_ids, cu_seqlens=cu_seqlens)


class MultiTokenPrediction(nn.Module):
    """The MTP modules, `layers` keyed by their block number (num_layers + k, DeepSeek's
    numbering), so that each module's tensors group with the checkpoint's layer."""

    def __init__(self, config: TransformerConfig, block, norm):
        super().__init__()
        first = config.num_layers
        self.layers = nn.ModuleDict(
            {
                str(i): MTPLayer(i, config, block(i), norm)
                for i in range(first, first + config.num_nextn_predict_layers)
            }
        )
        self.cp_group: dist.ProcessGroup | None = None
        """Context parallel: the ranks holding zig-zag shares of the same sequences."""
        self.aux_grad_scale = 1.0
        """Pipeline parallel: the micro-batch's share of the step that the loss attached to
        the last stage's output carries (set by the trainer's step, as MoE's)."""

    def init_weights(self, init: ParamInit, std: float) -> None:
        for layer in self.layers.values():
            layer.init_weights(init, std)


def shift_left(t: Tensor, k: int, fill: int) -> Tensor:
    """(batch, seq) -> t[:, k:] followed by k columns of `fill`."""
    return torch.cat([t[:, k:], t.new_full((t.shape[0], k), fill)], dim=1)


def ahead_embeddings(model: nn.Module, tokens: Tensor, depths: int) -> Tensor:
    """(batch, seq, depths * hidden): at each position the embeddings of the tokens 1 ..
    `depths` ahead (token 0 past a row's end), side by side. Under pipeline parallel the
    first stage computes them and they ride to the last stage with the hidden states, so
    the MTP modules use the first stage's embedding itself (no copy to keep in step)."""
    return torch.cat(
        [model.tok_embeddings(shift_left(tokens, k, 0)) for k in range(1, depths + 1)], -1
    )


def mtp_hidden_states(
    model: nn.Module,
    tokens: Tensor | None,
    hidden: Tensor,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    ahead: list[Tensor] | None = None,
    embedded: Tensor | None = None,
) -> list[Tensor]:
    """Final-norm hidden states (batch, seq, hidden) of every MTP depth of `model` (a
    `Transformer` with `mtp`), from its tokens (batch, seq) and its final-norm `hidden`.
    At depth k the last k positions have no token k ahead (they see token 0); their
    outputs are meaningless and `mtp_loss` ignores them. `ahead`: each depth's tokens k
    ahead, when they are not `tokens` shifted (context parallel); `embedded`: their
    embeddings already (`ahead_embeddings`: a pipeline's last stage, which has no
    embedding), in place of `tokens`."""
    rope = (model.rope_cos, model.rope_sin)
    width = hidden.shape[-1]
    out = []
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        if embedded is not None:
            embedded_k = embedded[..., (k - 1) * width : k * width]
        else:
            embedded_k = model.tok_embeddings(
                shift_left(tokens, k, 0) if ahead is None else ahead[k - 1]
            )
        hidden = layer(embedded_k, hidden, rope, position_ids, cu_seqlens)
        out.append(layer.norm(hidden))
    return out


def mtp_loss(
    model: nn.Module,
    tokens: Tensor | None,
    labels: Tensor,
    hidden: Tensor,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    embedded: Tensor | None = None,
) -> Tensor:
    """mtp_loss_scale x mean over depths k of the mean cross-entropy of token t_(i+1+k).

    Args:
        tokens: (batch, seq) input ids.
        labels: (batch, seq) the next token at each position (-100: not supervised), as in
            the training batch; depth k's target at i is labels[:, i + k].
        hidden: (batch, seq, hidden) the decoder's final-norm output for `tokens`.
        cu_seqlens: packed documents over the flattened batch * seq tokens.
        embedded: a pipeline's last stage: `ahead_embeddings` of the tokens (which it
            does not have: `tokens` is then None).

    Under context parallel (`model.mtp.cp_group`) `tokens` and `labels` are this rank's
    zig-zag share (`collate.shard_context_parallel`, or `shard_sequence` per row without
    `cu_seqlens`) and the result is this rank's share of the loss (see the module doc).
    """
    group = model.mtp.cp_group
    depths = range(1, len(model.mtp.layers) + 1)
    if group is not None:
        every = _gather_over_cp(tokens, labels, group)
        pairs = [_ahead_over_cp(every, tokens.shape, k, cu_seqlens, group) for k in depths]
        ahead, targets = [a for a, _ in pairs], [t for _, t in pairs]
    else:
        ahead, targets = None, [_shifted_targets(labels, k, cu_seqlens) for k in depths]
    states = mtp_hidden_states(
        model, tokens, hidden, position_ids, cu_seqlens, ahead=ahead, embedded=embedded
    )
    nlls, counts = [], []
    for h, target in zip(states, targets, strict=True):
        logits = model.project(h).float()  # (batch, seq, vocab), vocab-sharded: loss parallel
        nll = F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        nlls.append(full(nll))
        counts.append((target != IGNORE_INDEX).sum())
    counts = torch.stack(counts)
    scale = model.config.mtp_loss_scale
    if group is not None:  # the whole sequences' counts; this rank's share, x cp
        dist.all_reduce(counts, group=group)
        scale = scale * dist.get_world_size(group)
    losses = torch.stack(nlls) / counts.clamp(min=1)  # 0, not nan, where nothing is supervised
    return scale * losses.mean()


def _shifted_targets(labels: Tensor, k: int, cu_seqlens: Tensor | None) -> Tensor:
    """labels k ahead (batch, seq), -100 past a row's end or in another document."""
    target = shift_left(labels, k, IGNORE_INDEX)
    if cu_seqlens is not None:  # the token k further on is another document's
        flat = torch.arange(labels.numel(), device=labels.device)
        docs = torch.searchsorted(cu_seqlens[1:], flat, right=True).view_as(labels)
        target = target.masked_fill(shift_left(docs, k, -1) != docs, IGNORE_INDEX)
    return target


def _gather_over_cp(tokens: Tensor, labels: Tensor, group) -> Tensor:
    """(cp, 2, local_tokens): every cp rank's token ids and labels, by cp rank."""
    local = torch.stack([tokens.flatten(), labels.flatten()])
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.stack(pieces)


def _ahead_over_cp(
    every: Tensor, shape: torch.Size, k: int, cu_seqlens: Tensor | None, group
) -> tuple[Tensor, Tensor]:
    """Context parallel: the tokens (0 past the end) and labels (-100 past the end) k
    positions ahead of this rank's positions, within each document, (batch, seq) each,
    from `every` rank's (`_gather_over_cp`).

    Every rank holds, of each (padded) document of 2 x cp chunks of m tokens, chunk r then
    chunk 2cp-1-r, and every rank the same local boundaries (`packed_shard_index`); without
    `cu_seqlens` each row is one document. Global position p of the document is chunk
    p // m, which rank c holds first (c < cp) or rank 2cp-1-c holds second."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    device, n = every.device, every.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, n + 1, shape[1], device=device)
    pos = torch.arange(n, device=device)
    doc = torch.searchsorted(cu_seqlens[1:].long(), pos, right=True)
    start = cu_seqlens[doc].long()
    m = ((cu_seqlens[doc + 1].long() - start) // 2).clamp(min=1)  # chunk length
    j = pos - start
    first = j < m
    p = torch.where(first, rank * m + j, (2 * cp - 1 - rank) * m + j - m) + k
    inside = p < 2 * cp * m
    c = p // m
    src = torch.where(c < cp, c, 2 * cp - 1 - c).clamp(0, cp - 1)
    at = (start + torch.where(c < cp, p % m, m + p % m)).clamp(max=n - 1)
    found = every[src, :, at]  # (local_tokens, 2)
    ahead = found[:, 0].masked_fill(~inside, 0).view(shape)
    target = found[:, 1].masked_fill(~inside, IGNORE_INDEX).view(shape)
    return ahead, target


def take_mtp_loss(model: nn.Module) -> Tensor | None:
    """The weighted MTP loss the last training forward of `model` kept (then forgotten),
    or None (no MTP modules, or no forward with `mtp_labels` since the last take)."""
    for module in model.modules():  # the decoder itself, or inside a wrapper
        loss = getattr(module, "last_mtp_loss", None)
        if loss is not None:
            module.last_mtp_loss = None
            return loss
    return None
