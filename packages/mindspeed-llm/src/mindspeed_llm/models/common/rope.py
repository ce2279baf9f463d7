"""RoPE tables with scaling (linear, llama3, YaRN), computed exactly as transformers does.

Parity with Hugging Face needs bit-identical tables, so the inverse frequencies follow
transformers' `ROPE_INIT_FUNCTIONS` step by step in fp32, and the angles are one fp32
multiply (position * inv_freq), as in its rotary embedding forward. YaRN's magnitude
correction ("attention factor") is folded into both tables.

The layout is rotate-half (pairs i and i + head_dim/2), the same as Hugging Face's Llama,
Qwen and Mistral weights, so their q/k projections need no permutation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mindspeed_llm.models.config import TransformerConfig


def _default_inv_freq(dim: int, base: float) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: Tensor, scaling: dict) -> Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the middle band interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, scaling: dict) -> Tensor:
    factor = scaling["factor"]
    beta_fast, beta_slow = scaling["beta_fast"] or 32, scaling["beta_slow"] or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def inv_frequencies(config: TransformerConfig) -> Tensor:
    """fp32 (rope_head_dim // 2,) inverse frequencies after scaling (rope_head_dim: head_dim,
    or qk_rope_head_dim with latent attention); with a partial `rotary_dim`, those of a
    rotary_dim-wide RoPE followed by zeros (pairs left as they are)."""
    full = config.rope_head_dim
    if config.rotary_dim is not None and config.rotary_dim < full:
        partial = _scaled_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
        return torch.cat([partial, partial.new_zeros((full - config.rotary_dim) // 2)])
    return _scaled_inv_freq(full, config.rope_theta, config.rope_scaling)


def _scaled_inv_freq(dim: int, base: float, scaling: dict | None) -> Tensor:
    if scaling is None:
        return _default_inv_freq(dim, base)
    if scaling["type"] == "linear":
        return _default_inv_freq(dim, base) / scaling["factor"]
    if scaling["type"] == "llama3":
        return _llama3(_default_inv_freq(dim, base), scaling)
    assert scaling["type"] == "yarn", scaling
    return _yarn(dim, base, scaling)


def attention_factor(config: TransformerConfig) -> float:
    """YaRN's scale of cos/sin (1.0 for every other kind of RoPE)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["type"] != "yarn":
        return 1.0
    if scaling["attention_factor"] is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling["mscale"] and scaling["mscale_all_dim"]:
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def rope_tables(
    config: TransformerConfig, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin, each (max_position_embeddings, rope_head_dim // 2), for
    `rotary_embedding`."""
    inv_freq = inv_frequencies(config).to(device)
    positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # (positions, head_dim // 2)
    scale = attention_factor(config)
    return angles.cos() * scale, angles.sin() * scale
