"""FLOPs per token, tokens per second and model FLOPs utilisation (MFU).

Training FLOPs per token of a decoder-only transformer (forward + backward = 3x
forward; PaLM appendix B, as in Megatron-LM and torchtitan):

    flops_per_token = 6 * N + 12 * L * h * s

- N: parameters that do a matmul per token: every weight except the input
  embedding table (a lookup, not a matmul); for MoE only the *active* ones
  (shared weights + top_k experts per layer, see `moe_active_params`);
- 12 * L * h * s: attention scores and weighted values (2 matmuls of s x h per
  token per layer, x2 for multiply-add, x3 for forward + backward), counted for
  the full s x s square as PaLM does, although a causal mask skips half.

MFU = achieved FLOPs per second per device / the device's peak FLOPs.
"""

from __future__ import annotations

import time

from torch import nn


def dense_params(model: nn.Module, *, exclude: tuple[type, ...] = (nn.Embedding,)) -> int:
    """Parameters used by modules other than `exclude` types (default: embedding lookups).

    A weight tied between the embedding and the output projection counts once,
    since the projection is a matmul.
    """
    used = {}
    for module in model.modules():
        if not isinstance(module, exclude):
            for p in module.parameters(recurse=False):
                used[id(p)] = p.numel()
    return sum(used.values())


def moe_active_params(total: int, expert_params: int, num_experts: int, top_k: int) -> int:
    """Parameters one token uses in an MoE model.

    Args:
        total: all matmul parameters (embeddings excluded), experts included.
        expert_params: parameters of all routed experts together.
        num_experts / top_k: routed experts per layer and how many a token visits.
    """
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    return total - expert_params + expert_params * top_k // num_experts


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> int:
    """Training FLOPs per token (see the module docstring for the formula)."""
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation of one device processing `tokens_per_s`."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0


class ThroughputMeter:
    """Tokens per second per device between two calls of `update`."""

    def __init__(self, flops_per_token: float, peak_flops: float, clock=time.perf_counter):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._clock = clock
        self._last = clock()

    def update(self, num_tokens: int) -> dict[str, float]:
        """`num_tokens` processed by this device since the last call."""
        now = self._clock()
        elapsed, self._last = max(now - self._last, 1e-9), now
        tokens_per_s = num_tokens / elapsed
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * self.flops_per_token / 1e12,
            "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak_flops),
        }
