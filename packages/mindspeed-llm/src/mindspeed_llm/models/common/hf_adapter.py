"""State-dict names to and from Hugging Face, for every dense family.

Llama, Qwen2, Qwen3 and Mistral checkpoints share one naming scheme; what differs is
which optional tensors exist (q/k/v biases for Qwen2, q_norm/k_norm for Qwen3), and the
config flags (`qkv_bias`, `qk_norm`) say that. Only names change: Hugging Face keeps
q_proj/k_proj in the rotate-half RoPE layout (its conversion scripts already permuted
Meta's interleaved weights), which is the layout our RoPE uses, so no tensor is permuted,
split or concatenated. Tensors pass through as they are (plain or DTensor, any dtype).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mindspeed_core.errors import CheckpointError
from mindspeed_llm.models.config import TransformerConfig

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_POST_NORMS = {  # Gemma 2: its post_attention_layernorm is on the attention's output
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
# Buffers some older Hugging Face checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def name_map(config: TransformerConfig) -> dict[str, str]:
    """Our parameter name -> Hugging Face name, for every tensor of the model."""
    layer = dict(_LAYER)
    if config.qkv_bias:
        layer.update(_QKV_BIAS)
    if config.qk_norm:
        layer.update(_QK_NORM)
    if config.post_norms:
        layer.update(_POST_NORMS)
    names = dict(_TOP)
    if config.tie_word_embeddings:
        del names["output.weight"]
    for i in range(config.num_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for ours, hf in layer.items()})
    return names


def to_hf(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face names (a tied output is left out, as HF saves it).

    Raises:
        CheckpointError: a tensor is missing or one has no Hugging Face name.
    """
    names = name_map(config)
    extra = set(state_dict) - set(names)
    if config.tie_word_embeddings:
        extra.discard("output.weight")
    _check(missing=set(names) - set(state_dict), unexpected=extra, side="our")
    return {hf: state_dict[ours] for ours, hf in names.items()}


def from_hf(hf_state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """A Hugging Face state dict -> our names (with `output.weight` = embedding when tied).

    Raises:
        CheckpointError: a tensor is missing or one is not part of this model.
    """
    to_ours = {hf: ours for ours, hf in name_map(config).items()}
    check_hf_keys(hf_state_dict, set(to_ours), config)
    out = {ours: hf_state_dict[hf] for hf, ours in to_ours.items()}
    if config.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def check_hf_keys(
    hf_state_dict: Mapping[str, Tensor],
    wanted: set[str],
    config: TransformerConfig,
    *,
    tied_copy: str = "lm_head.weight",
    allowed: set[str] = frozenset(),
) -> None:
    """Refuse a Hugging Face state dict that lacks a tensor of `wanted` or holds one that is
    neither wanted nor `allowed` (buffers with an ignored suffix pass; so does `tied_copy`,
    the output head some tied checkpoints store anyway).

    Raises:
        CheckpointError: naming a few of the missing and unexpected tensors.
    """
    present = {k for k in hf_state_dict if not k.endswith(_IGNORED_SUFFIXES)}
    extra = present - wanted - allowed
    if config.tie_word_embeddings:
        extra.discard(tied_copy)
    _check(missing=wanted - present, unexpected=extra, side="Hugging Face")


def _check(*, missing: set[str], unexpected: set[str], side: str) -> None:
    problems = []
    if missing:
        problems.append(f"missing {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {_some(unexpected)}")
    if problems:
        raise CheckpointError(
            f"{side} state dict does not fit the model config: {'; '.join(problems)}"
        )


def _some(keys: set[str], limit: int = 5) -> str:
    shown = sorted(keys)[:limit]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(shown) + more
