"""torch.compile(fullgraph=True) over a small block built from the ops, on CPU."""

from __future__ import annotations

import torch

import mindspeed_ops as mo


class TinyBlock(torch.nn.Module):
    """rms_norm -> qkv -> rotary -> packed attention -> rms_norm -> swiglu MLP -> fused loss."""

    def __init__(self, hidden=24, heads=4, kv_heads=2, vocab=50):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1 = torch.nn.Parameter(torch.randn(hidden) * 0.1)
        self.norm2 = torch.nn.Parameter(torch.randn(hidden) * 0.1)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * 40, bias=False)
        self.down = torch.nn.Linear(40, hidden, bias=False)
        self.out = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.1)
        cos, sin = mo.rotary_tables(self.head_dim, 64)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, target, cu_seqlens, positions):
        # x: (tokens, hidden), several sequences packed
        tokens = x.shape[0]
        h = mo.rms_norm(x, self.norm1, offset=True)
        q, k, v = self.qkv(h).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1,
        )  # fmt: skip
        q = mo.rotary_embedding(q.view(tokens, self.heads, -1), self.cos, self.sin, positions)
        k = mo.rotary_embedding(k.view(tokens, self.kv_heads, -1), self.cos, self.sin, positions)
        v = v.view(tokens, self.kv_heads, -1)
        attn = mo.attention(q, k, v, cu_seqlens=cu_seqlens, window=4)
        x = x + self.proj(attn.reshape(tokens, -1))
        x = x + self.down(mo.swiglu(self.up(mo.rms_norm(x, self.norm2))))
        logits_loss = mo.cross_entropy(x @ self.out.t(), target, chunk_size=3)
        return logits_loss + mo.linear_cross_entropy(x, self.out, target, chunk_size=5)


def test_compile_fullgraph_block_matches_eager():
    torch.manual_seed(0)
    block = TinyBlock()
    x = torch.randn(11, 24)
    target = torch.randint(0, 50, (11,))
    cu = torch.tensor([0, 4, 11])
    positions = mo.position_ids_from_cu_seqlens(cu)

    eager_loss = block(x, target, cu, positions)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()

    compiled = torch.compile(block, fullgraph=True, backend="inductor")
    loss = compiled(x, target, cu, positions)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    for got, want in zip([p.grad for p in block.parameters()], eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_optional_library_lookup_is_a_constant_in_a_compiled_block(monkeypatch):
    """The CUDA paths ask whether liger/fla are installed from inside compiled blocks; torch
    2.11's dynamo refuses to trace importlib there (a fullgraph Llama block failed to compile
    on an H200). The answer must come without importlib while tracing."""
    import importlib.util

    from mindspeed_ops.backends import has_module

    expected = has_module("liger_kernel")

    def refuse(*args, **kwargs):
        raise AssertionError("find_spec called while tracing")

    monkeypatch.setattr(importlib.util, "find_spec", refuse)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 3 if has_module("liger_kernel") else x + 1,
                       fullgraph=True, backend="eager")  # fmt: skip
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0 if expected else 2.0))
