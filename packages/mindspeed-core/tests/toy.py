"""A tiny Llama-like decoder written as a plain module, its tensor-parallel plan, and
helpers to train it.

The forward uses local head counts (``view(b, s, -1, head_dim)``), which is all a
plain model needs to run under a tensor-parallel plan. Core knows no model: the plan
is written here, beside the toy, as a real model keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from mindspeed_core.parallel import dtensor


@dataclass
class ToyConfig:
    vocab: int = 128
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq: int = 32


def rope_cache(head_dim: int, seq: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)  # (seq, head_dim / 2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # (seq, head_dim)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim)
    cos, sin = cache[: x.shape[1]].chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class ToyLlama(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.register_buffer(
            "rope", rope_cache(cfg.dim // cfg.num_heads, cfg.max_seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (batch, seq, dim)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))  # (batch, seq, vocab)


def make_model(seed: int = 0, cfg: ToyConfig | None = None, dtype=torch.float32) -> ToyLlama:
    torch.manual_seed(seed)
    return ToyLlama(cfg or ToyConfig()).to(dtype)


def make_batches(num_steps: int, batch: int = 4, seq: int = 16, vocab: int = 128, seed: int = 1):
    """(tokens, labels) per step: the same on every rank; each dp rank slices its part.

    Each row counts up from a random start (mod vocab), so the model has something
    to learn and the loss falls within a few steps.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (num_steps, batch, 1), generator=gen)
    data = (starts + torch.arange(seq + 1)) % vocab
    return [(d[:, :-1], d[:, 1:]) for d in data]


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of the whole value of a (possibly DTensor) tensor."""
    return dtensor.full(t).detach().clone()


def tp_plan(*, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """The toy's plan: vocab-parallel embedding and output, column-parallel q/k/v and
    gate/up, row-parallel o and down; norms sharded along the sequence with `sequence_parallel`."""
    seq = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(
        input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
    )
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention": gather,
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    colwise = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    plan.update({f"layers.*.{name}": ColwiseParallel() for name in colwise})
    if sequence_parallel:
        for name in ("norm", "layers.*.attention_norm", "layers.*.ffn_norm"):
            plan[name] = SequenceParallel()
    return plan
