"""The tensor-parallel plan of our decoder, written as data (torchtitan's Llama plan).

Vocab-parallel embedding, column-parallel q/k/v and gate/up, row-parallel o and down,
optional sequence parallel (norms and residuals sharded along the sequence) and loss
parallel (logits stay sharded over the vocabulary and the cross entropy runs on the
shards inside `loss_parallel()`). `mindspeed_core.parallel.apply_tp` checks and applies
it; the plan lives here, beside the model whose submodule names it spells.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from mindspeed_core.errors import ParallelError


@dataclass(frozen=True)
class LlamaNames:
    """Submodule names of a Llama-style decoder (`Transformer`'s, torchtitan's, by default)."""

    embedding: str = "tok_embeddings"
    layers: str = "layers"
    norm: str = "norm"
    output: str = "output"
    attention: str = "attention"
    attention_norm: str = "attention_norm"
    wq: str = "wq"
    wk: str = "wk"
    wv: str = "wv"
    wo: str = "wo"
    feed_forward: str = "feed_forward"
    ffn_norm: str = "ffn_norm"
    w1: str = "w1"
    w2: str = "w2"
    w3: str = "w3"


def llama_tp_plan(
    *,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    attention_extra_args: int = 1,
    names: LlamaNames = LlamaNames(),
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a Llama-style decoder.

    Args:
        num_heads / num_kv_heads: attention heads; both must be divisible by `tp`.
        tp: tensor-parallel degree the plan is meant for.
        sequence_parallel: shard norms and residual activations along the sequence.
        loss_parallel: keep logits sharded over the vocabulary (compute the loss
            inside `loss_parallel_context(True)`).
        attention_extra_args: positional arguments the attention module takes after
            the hidden states (e.g. 1 for RoPE frequencies); they pass through as is.
        names: the submodule names of the model.

    Raises:
        ParallelError: tp does not divide the heads.
    """
    for label, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if heads % tp:
            raise ParallelError(f"tp={tp} does not divide {label}={heads}")
    n = names
    seq = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(
        input_layouts=(seq, *([None] * attention_extra_args)),
        desired_input_layouts=(Replicate(), *([None] * attention_extra_args)),
    )
    plan: dict[str, ParallelStyle] = {
        n.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        n.output: ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        n.attention: gather,
        f"{n.attention}.{n.wq}": ColwiseParallel(),
        f"{n.attention}.{n.wk}": ColwiseParallel(),
        f"{n.attention}.{n.wv}": ColwiseParallel(),
        f"{n.attention}.{n.wo}": RowwiseParallel(output_layouts=seq),
        n.feed_forward: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        f"{n.feed_forward}.{n.w1}": ColwiseParallel(),
        f"{n.feed_forward}.{n.w3}": ColwiseParallel(),
        f"{n.feed_forward}.{n.w2}": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan[n.norm] = SequenceParallel()
        block[n.attention_norm] = SequenceParallel()
        block[n.ffn_norm] = SequenceParallel()
    plan.update({f"{n.layers}.*.{k}": v for k, v in block.items()})
    return plan


def with_moe_layers(
    plan: dict[str, ParallelStyle],
    moe_layers: list[str],
    dense_layers: list[str],
    *,
    sequence_parallel: bool = False,
    shared_expert: bool = False,
    names: LlamaNames = LlamaNames(),
) -> dict[str, ParallelStyle]:
    """`plan` with its feed-forward entries spelled out per layer for a model with MoE
    blocks (`moe_layers`, e.g. ["1", "2"]) beside dense ones (`dense_layers`).

    A MoE block keeps its routed experts whole on every tp rank (expert parallel, if
    any, spreads them over `ep`): it takes the whole (gathered) sequence as a plain
    tensor and gives back its slice, so each tp rank routes the same tokens and the
    router's statistics count each token once. A shared expert is split like a dense
    feed-forward, its output summed over tp inside the block.
    """
    n, seq = names, Shard(1) if sequence_parallel else Replicate()
    ffn = f"{n.layers}.*.{n.feed_forward}"
    dense = {k: v for k, v in plan.items() if fnmatch.fnmatchcase(k, f"{ffn}*")}
    out = {k: v for k, v in plan.items() if k not in dense}
    for layer in dense_layers:
        out.update(
            {k.replace(f"{n.layers}.*", f"{n.layers}.{layer}", 1): v for k, v in dense.items()}
        )
    for layer in moe_layers:
        block = f"{n.layers}.{layer}.{n.feed_forward}"
        out[block] = PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        )
        if shared_expert:
            out[f"{block}.shared_expert.{n.w1}"] = ColwiseParallel()
            out[f"{block}.shared_expert.{n.w3}"] = ColwiseParallel()
            out[f"{block}.shared_expert.{n.w2}"] = RowwiseParallel()
    return out


LATENT_REPLICATED = ("wq_a", "q_norm", "wkv_a", "kv_norm")
"""Multi-head latent attention's low-rank parts: replicated DTensors under tensor parallel."""


def with_latent_attention(
    plan: dict[str, ParallelStyle], names: LlamaNames = LlamaNames()
) -> dict[str, ParallelStyle]:
    """`plan` for multi-head latent attention (`mla.MultiLatentAttention`): its heads split
    like Llama's (wq or the low-rank wq_b, and wkv_b, which expands each head's key and
    value, by column; wo by row); the low-rank parts stay whole (see LATENT_REPLICATED)."""
    attention = f"{names.layers}.*.{names.attention}"
    out = {
        k: v
        for k, v in plan.items()
        if k not in (f"{attention}.{names.wk}", f"{attention}.{names.wv}")
    }
    out[f"{attention}.wq_b"] = ColwiseParallel()
    out[f"{attention}.wkv_b"] = ColwiseParallel()
    return out


def with_mtp_blocks(
    plan: dict[str, ParallelStyle], mtp_layers: list[str], names: LlamaNames = LlamaNames()
) -> dict[str, ParallelStyle]:
    """`plan` with the decoder blocks of the MTP modules (`mtp.layers.<i>.block`, i in
    `mtp_layers`) planned as decoder block i would be: every `layers.*.<x>` entry and
    every `layers.<i>.<x>` entry (`with_moe_layers` spells MoE blocks per layer; list the
    MTP blocks there too) becomes `mtp.layers.<i>.block.<x>`. The rest of an MTP module
    (its norms and eh_proj) takes whole hidden states and runs whole on every rank."""
    prefix = f"{names.layers}."
    out = {}
    for key, style in plan.items():
        layer, _, rest = key[len(prefix) :].partition(".")
        if not key.startswith(prefix) or not rest:
            out[key] = style
            continue
        if layer not in mtp_layers:
            out[key] = style
        for i in mtp_layers:
            if layer in ("*", i):
                out[f"mtp.{names.layers}.{i}.block.{rest}"] = style
    return out
