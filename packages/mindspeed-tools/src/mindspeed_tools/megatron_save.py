"""Hugging Face Llama/Qwen folders -> Megatron's legacy per-rank checkpoint at a chosen tp/pp.

The layout Megatron-LM's `save_checkpoint` writes with `--ckpt-format torch`
(megatron/training/checkpointing.py, `get_checkpoint_name`):
`latest_checkpointed_iteration.txt` holding `1`, and
`iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt`, a `torch.save` of {"args",
"checkpoint_version": 3.0, "iteration": 1, "model"}; each "model" is the rank's shard of
Megatron-Core's local-spec GPTModel state dict, layers numbered within the stage. Iteration
1, as MindSpeed-LLM's converter writes it ("0" and "release" are not resumed from).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_tools.megatron import (
    _TP_DIM,  # split dims of Megatron's tensors over tp
    LATEST_FILE,
    LEGACY_FILE,
)

ITERATION = 1
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_NAMES = {  # Hugging Face (within a layer) -> Megatron-Core local spec
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def check_config(config: TransformerConfig, source: Path, tp: int, pp: int) -> None:
    """Refuse what Megatron's dense GPT layout or the layout cannot hold (named)."""
    groups = config.num_kv_heads or config.num_heads
    problems = {
        "model_type": config.family not in _FAMILIES,
        "sliding_window": config.sliding_window is not None,
        "rope_scaling": config.rope_scaling is not None,
        f"num_hidden_layers={config.num_layers} (not divisible by --pp {pp})": (
            config.num_layers % pp != 0
        ),
        f"num_key_value_heads={groups} (not divisible by --tp {tp})": groups % tp != 0,
        f"vocab_size={config.vocab_size} (not divisible by --tp {tp})": config.vocab_size % tp != 0,
        f"intermediate_size={config.intermediate_size} (not divisible by --tp {tp})": (
            config.intermediate_size % tp != 0
        ),
    }
    for what, bad in problems.items():
        if bad:
            raise ConfigError(
                f"{source / hf_io.CONFIG_FILE}: {what}: not written as a dense Megatron GPT "
                f"checkpoint (families: {', '.join(_FAMILIES)}, no sliding window or RoPE scaling)"
            )


def megatron_args(
    config: TransformerConfig, tp: int, pp: int, dtype: torch.dtype
) -> argparse.Namespace:
    """The args Megatron-LM would have saved for this model (its argument names)."""
    heads = config.num_heads
    groups = config.num_kv_heads or heads
    return argparse.Namespace(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=config.head_dim or config.hidden_size // heads,
        max_position_embeddings=config.max_position_embeddings,
        padded_vocab_size=config.vocab_size,
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=1,
        normalization="RMSNorm",
        norm_epsilon=config.norm_eps,
        swiglu=True,
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=int(config.rope_theta),
        rotary_percent=1.0,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        add_bias_linear=False,
        add_qkv_bias=config.qkv_bias,
        qk_layernorm=config.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q, k, v -> Megatron's fused rows, per query group [its q heads | k | v]."""
    rest = q.shape[1:]
    parts = (t.reshape(groups, -1, *rest) for t in (q, k, v))
    return torch.cat(list(parts), dim=1).reshape(-1, *rest)


def to_megatron(hf: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> Megatron's whole tensors (global layer numbers)."""
    groups = config.num_kv_heads or config.num_heads
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    out["output_layer.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, ours in _LAYER_NAMES.items():
            if src + name in hf:
                out[dst + ours] = hf[src + name]
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            q, k, v = (hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, groups)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
    return out


def rank_state(
    whole: dict[str, torch.Tensor],
    config: TransformerConfig,
    tp: int,
    pp: int,
    tp_rank: int,
    pp_rank: int,
) -> dict[str, torch.Tensor]:
    """The tensors Megatron-Core's (tp_rank, pp_rank) GPTModel holds, under its local names."""
    per_stage = config.num_layers // pp
    top_here = {
        "embedding.word_embeddings.weight": pp_rank == 0,
        "decoder.final_layernorm.weight": pp_rank == pp - 1,
        # tied: the last stage keeps its own copy of the embedding, unless it is the first
        "output_layer.weight": pp_rank == pp - 1 and not (config.tie_word_embeddings and pp == 1),
    }
    state = {}
    for name, tensor in whole.items():
        if name.startswith("decoder.layers."):
            index, rest = name.removeprefix("decoder.layers.").split(".", 1)
            stage, local = divmod(int(index), per_stage)
            if stage != pp_rank:
                continue
            key = f"decoder.layers.{local}.{rest}"
        elif top_here[name]:
            key = rest = name
        else:
            continue
        state[key] = _tp_shard(rest, tensor, tp, tp_rank).clone()
    return state


def _tp_shard(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if name == "mlp.linear_fc1.weight":  # [gate; up]: each rank holds [gate_r; up_r]
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    dim = _TP_DIM.get(name)
    return tensor if dim is None else tensor.chunk(tp, dim=dim)[rank]


def write_legacy(
    tmp: Path, hf: dict[str, torch.Tensor], config: TransformerConfig, tp: int, pp: int, args: Any
) -> None:
    """Write the per-rank files and `latest_checkpointed_iteration.txt` into `tmp`."""
    whole = to_megatron(hf, config)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            folder = tmp / f"iter_{ITERATION:07d}" / name
            folder.mkdir(parents=True)
            model = rank_state(whole, config, tp, pp, tp_rank, pp_rank)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
            torch.save({**state, "model": model}, folder / LEGACY_FILE)
    (tmp / LATEST_FILE).write_text(f"{ITERATION}\n")
