"""Megatron-LM / Megatron-Core checkpoints, read without running code, as Hugging Face tensors.

A Megatron checkpoint folder holds `latest_checkpointed_iteration.txt` (an iteration
number, or `release`) and `iter_NNNNNNN/` (or `release/`) in one of two formats:

- legacy (`--ckpt-format torch`): `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per
  tensor/pipeline(/expert) rank, a `torch.save` of {"args": Namespace, "model": state dict,
  ...}, each tensor the rank's shard, layers numbered within the stage;
- `torch_dist` (Megatron's dist_checkpointing): a DCP folder of global tensors (layers
  stacked along a leading axis) plus `common.pt` (the args) and `metadata.json`.

Both pickles are read with `torch.load(weights_only=True)` allowing `argparse.Namespace`
(the args); the data-only classes a training checkpoint also holds (Megatron's enums in
the args, numpy's RNG state) unpickle into inert stand-ins, never into themselves. DCP's
`.metadata` goes through our `MetadataUnpickler`. Nothing a file names is ever called: a
pickle naming anything else (os.system, builtins.eval, ...) is refused before it loads.

The model's shape comes from the saved args (Megatron-LM's argument names); the tensors
are merged over tp/pp and renamed to the Hugging Face Llama/Qwen layout, which the
existing `mindspeed convert` paths then write (see `convert.megatron_to_hf`). Nothing is
read whole: a legacy rank file is unpickled onto the meta device (its structure, and where
each tensor's bytes are) and each tensor's shards are read from their offsets, merged,
handed on and dropped; a torch_dist folder is read one layer's slice at a time through
DCP. Memory holds about the largest tensor, whatever the model's size.
Dense Llama/Mistral/Qwen2/Qwen3-style models (RMSNorm, SwiGLU, RoPE) are converted, and
their MoE kin with softmax top-k routing and no shared expert: Mixtral (no qk-norm) and
Qwen3-MoE (qk-norm), the experts merged over expert-parallel ranks (legacy files
`mp_rank_TT[_PPP]_EEE`; torch_dist stacks them along an expert axis). Virtual-pipeline
chunks (`model0`, `model1`, ... in a legacy rank file) are renumbered to global layers.
What is not converted (shared experts, sigmoid or group-limited routing, uneven stages)
is refused by the arg that asks for it.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.checkpoint import read_safe_metadata
from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_tools.dcp_stream import Region, RegionReader

LATEST_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# one expert's fc in each of Megatron's spellings -> `mlp.experts.E.linear_fcN.weight`:
# SequentialMLP (local spec) and TEGroupedMLP (Transformer Engine) in a legacy rank file
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.weight)(\d+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(linear_fc[12]\.weight)$")
_STACKED_EXPERTS = "mlp.experts.experts."  # torch_dist: (layers, experts, ...)
_SKIPPED = ("._extra_state",)
_NAMESPACE = "argparse.Namespace"
_STDLIB_DATA = {"types.SimpleNamespace", "pathlib.PosixPath", "io.BytesIO", "signal.Signals"}

# Megatron layer tensor (local or Transformer-Engine spec) -> Hugging Face, per layer.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# How a legacy rank file's tensor is split over tensor-parallel ranks: the dim, or None
# when every rank holds all of it.
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}


def is_megatron_checkpoint(path: str | Path) -> bool:
    """`path` holds `latest_checkpointed_iteration.txt` (a Megatron save folder)."""
    return (Path(path) / LATEST_FILE).is_file()


def iteration_dir(root: Path) -> Path:
    """The folder of the iteration `latest_checkpointed_iteration.txt` names.

    Raises:
        CheckpointError: the file names neither a number nor `release`, or its folder is missing.
    """
    text = (root / LATEST_FILE).read_text().strip()
    if text == "release":
        folder = root / "release"
    elif text.isdigit():
        folder = root / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{root / LATEST_FILE} holds {text[:40]!r}, not an iteration number")
    if not folder.is_dir():
        raise CheckpointError(
            f"{root / LATEST_FILE} names iteration {text}, but {folder} is missing"
        )
    return folder


# -- reading pickles without running code --------------------------------------------------


class _StandIn:
    """What a data-only global of a Megatron pickle (an enum in the args, numpy's RNG
    state, an OptimizerConfig) unpickles into instead of itself: it keeps its arguments
    and state and runs nothing. The converter reads none of them."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.args}>"


def _stand_in(name: str) -> bool:
    """Whether global `name` may be replaced by a `_StandIn`: the data classes Megatron's own
    loader allowlists (megatron/core/safe_globals.py), never the callables themselves."""
    return name.startswith(("megatron.", "numpy.")) or name in _STDLIB_DATA


def safe_torch_load(file: Path, *, meta: bool = False) -> Any:
    """A `torch.save` file read with weights_only (tensors, containers, numbers, strings)
    plus `argparse.Namespace`. Megatron's data-only globals (its enums, numpy RNG state,
    configs) become inert `_StandIn`s; any other global is refused before anything loads.
    With `meta`, tensors come on the meta device and no tensor byte is read: each
    storage's `_checkpoint_offset` says where its bytes are in the file (`_RankFile`).

    Raises:
        CheckpointError: the file names another global, or is corrupt (named).
    """
    try:
        # lists the pickle's globals without unpickling it
        found = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        unsafe = [g for g in found if g != _NAMESPACE]
        refused = [g for g in unsafe if not _stand_in(g)]
        if refused:
            raise CheckpointError(
                f"{file}: refused to unpickle {', '.join(refused[:3])}: Megatron checkpoints "
                "are read without running code (only tensors, containers and argparse.Namespace)"
            )
        stand_ins = [(type(g.rsplit(".", 1)[-1], (_StandIn,), {}), g) for g in unsafe]
        with torch.serialization.safe_globals([argparse.Namespace, *stand_ins]):
            if meta:
                return torch.load(file, map_location="meta", weights_only=True)
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:
        first = " ".join(str(err).split())[:200]
        raise CheckpointError(f"{file} is truncated, corrupt or unsafe ({first})") from None


# -- the model's shape, from Megatron-LM's args ---------------------------------------------


def _arg(args: Mapping[str, Any], name: str, file: Path, default: Any = ...) -> Any:
    if name in args and args[name] is not None:
        return args[name]
    if default is ...:
        raise CheckpointError(f"{file}: the saved args have no {name}")
    return default


def hf_config(args: Mapping[str, Any], file: Path) -> dict[str, Any]:
    """The Hugging Face config.json of the model Megatron-LM's args describe.

    Raises:
        ConfigError: an architecture feature we do not convert (the arg is named).
    """

    def refuse(name: str, why: str) -> ConfigError:
        return ConfigError(f"{file}: args.{name}={args.get(name)!r}: {why}")

    checks = (
        ("normalization", lambda v: v == "RMSNorm", "only RMSNorm models are converted"),
        ("swiglu", bool, "only SwiGLU MLPs (Llama/Qwen/Mistral) are converted"),
        ("position_embedding_type", lambda v: v == "rope", "only RoPE models are converted"),
    )
    for name, ok, why in checks:
        if not ok(args.get(name)):
            raise refuse(name, why)
    for name, why in (
        ("add_bias_linear", "linear-layer biases have no Hugging Face Llama/Qwen equivalent"),
        ("multi_latent_attention", "DeepSeek's multi-latent attention is not converted yet"),
        ("rotary_interleaved", "interleaved RoPE is not converted"),
        ("use_rope_scaling", "Llama-3.1 RoPE scaling is not converted yet"),
        ("decoder_first_pipeline_num_layers", "uneven pipeline stages are not converted"),
        ("decoder_last_pipeline_num_layers", "uneven pipeline stages are not converted"),
        ("account_for_embedding_in_pipeline_split", "uneven pipeline stages are not converted"),
        ("account_for_loss_in_pipeline_split", "uneven pipeline stages are not converted"),
        ("pipeline_model_parallel_layout", "uneven pipeline stages are not converted"),
    ):
        if args.get(name):
            raise refuse(name, why)
    if _arg(args, "rotary_percent", file, 1.0) != 1.0:
        raise refuse("rotary_percent", "partial RoPE is not converted")
    heads = _arg(args, "num_attention_heads", file)
    hidden = _arg(args, "hidden_size", file)
    groups = _arg(args, "num_query_groups", file) if args.get("group_query_attention") else heads
    qkv_bias, qk_norm = bool(args.get("add_qkv_bias")), bool(args.get("qk_layernorm"))
    model_type = "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"
    experts = _moe_config(args, file, qk_norm, qkv_bias, refuse) if args.get("num_experts") else {}
    model_type = experts.pop("model_type", model_type)
    architecture = {
        "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
        "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe",
    }[model_type]
    config = {
        "architectures": [architecture + "ForCausalLM"],
        "model_type": model_type,
        "vocab_size": _arg(args, "padded_vocab_size", file),
        "hidden_size": hidden,
        "intermediate_size": _arg(args, "ffn_hidden_size", file),
        "num_hidden_layers": _arg(args, "num_layers", file),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _arg(args, "kv_channels", file, hidden // heads),
        "max_position_embeddings": _arg(args, "max_position_embeddings", file),
        "rms_norm_eps": _arg(args, "norm_epsilon", file, 1e-5),
        "rope_theta": float(_arg(args, "rotary_base", file, 10000)),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        **experts,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    config["torch_dtype"] = dtype
    return config


def _moe_config(
    args: Mapping[str, Any], file: Path, qk_norm: bool, qkv_bias: bool, refuse: Any
) -> dict[str, Any]:
    """The experts' part of the Hugging Face config: Qwen3-MoE when the attention has
    qk-norm, Mixtral otherwise. Megatron's default routing (top-k of the router's logits,
    softmax over those k) is Mixtral's and Qwen3-MoE's `norm_topk_prob`; with
    `moe_router_pre_softmax` (softmax over all experts, then top-k) it is Qwen3-MoE's
    un-normalised routing."""
    for name, why in (
        ("moe_shared_expert_intermediate_size", "shared experts are not converted yet"),
        ("moe_router_enable_expert_bias", "aux-loss-free expert bias is not converted yet"),
        ("moe_router_num_groups", "group-limited routing is not converted yet"),
        ("moe_router_topk_scaling_factor", "scaled routing weights are not converted yet"),
    ):
        if args.get(name):
            raise refuse(name, why)
    if args.get("moe_router_score_function", "softmax") != "softmax":
        raise refuse("moe_router_score_function", "only softmax routing is converted")
    freq = args.get("moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, list) and set(freq) == {1})):
        raise refuse("moe_layer_freq", "only models whose every layer is MoE are converted")
    if qkv_bias:
        raise refuse("add_qkv_bias", "MoE with q/k/v biases (Qwen2-MoE) is not converted yet")
    num = _arg(args, "num_experts", file)
    topk = _arg(args, "moe_router_topk", file, 2)
    width = _arg(args, "moe_ffn_hidden_size", file, None) or _arg(args, "ffn_hidden_size", file)
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    if qk_norm:
        return {
            "model_type": "qwen3_moe", "num_experts": num, "num_experts_per_tok": topk,
            "moe_intermediate_size": width, "norm_topk_prob": not pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
        }
    if pre_softmax:
        raise refuse(
            "moe_router_pre_softmax", "Mixtral renormalises its top-k (qk-norm models only)"
        )
    return {
        "model_type": "mixtral", "num_local_experts": num, "num_experts_per_tok": topk,
        "intermediate_size": width, "sliding_window": None,
        "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
    }


# -- tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MegatronTensors:
    """The whole tensors of a Megatron checkpoint (merged over tp/pp/ep and virtual-pipeline
    chunks) under global names (`decoder.layers.L.<...>`, each expert as
    `decoder.layers.L.mlp.experts.E.linear_fcN.weight`), read one at a time: memory holds
    about one tensor (its shards and their merge), never the model."""

    args: dict[str, Any]
    """Megatron-LM's saved args."""
    folder: Path
    """The iteration folder."""
    meta: dict[str, torch.Tensor]
    """Name -> a meta tensor of the whole tensor's dtype and shape, in the order `items`
    yields them."""
    read: Callable[[], Iterator[tuple[str, torch.Tensor]]]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) in `meta`'s order, each read when it is asked for."""
        return self.read()

    def hf_meta(self, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors `hf_items` yields (meta), in its order.

        Raises:
            CheckpointError: a tensor with no Hugging Face name (before anything is read).
        """
        return to_hf_tensors(self.meta, config, self.folder)

    def hf_items(self, config: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor), each made from one Megatron tensor as it is read."""
        for name, tensor in self.items():
            yield from to_hf_tensors({name: tensor}, config, self.folder).items()


def read_checkpoint(root: str | Path) -> MegatronTensors:
    """The tensors of the Megatron save folder `root` (its latest iteration), in either
    format; the files' structure is read and checked now, the tensors when asked for.

    Raises:
        CheckpointError: a refused pickle, a missing or truncated rank file (named).
    """
    folder = iteration_dir(Path(root))
    if (folder / COMMON_FILE).is_file():
        return _read_torch_dist(folder)
    return _read_legacy(folder)


def _args_of(state: Any, file: Path) -> dict[str, Any]:
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{file} holds no saved args (a Megatron checkpoint saves 'args')")
    return vars(args)


def _rank_files(folder: Path) -> dict[tuple[int, ...], Path]:
    """The `mp_rank_TT[_AAA][_BBB]` numbers -> that rank's `model_optim_rng.pt`. Which of
    AAA/BBB is the pipeline and which the expert rank depends on the args (`_layout`)."""
    ranks = {}
    for sub in sorted(folder.iterdir()):
        match = _RANK_DIR.match(sub.name)
        if match and (sub / LEGACY_FILE).is_file():
            ranks[tuple(int(g) for g in match.groups() if g is not None)] = sub / LEGACY_FILE
    if not ranks:
        raise CheckpointError(
            f"{folder} has neither {COMMON_FILE} (torch_dist) nor mp_rank_*/{LEGACY_FILE}"
        )
    return ranks


def _layout(
    folder: Path, ranks: dict[tuple[int, ...], Path], tp: int, pp: int, ep: int
) -> dict[tuple[int, int, int], Path]:
    """(tp, pp, ep) rank -> its file, as Megatron-LM's `get_checkpoint_name` names them:
    `mp_rank_TT`, then `_PPP` when pp > 1, then `_EEE` when ep > 1.

    Raises:
        CheckpointError: a rank file is missing (named with the degrees the args give).
    """
    files = {}
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                numbers = (t, *((p,) if pp > 1 else ()), *((e,) if ep > 1 else ()))
                name = f"mp_rank_{t:02d}" + "".join(f"_{n:03d}" for n in numbers[1:])
                if numbers not in ranks:
                    raise CheckpointError(
                        f"{folder}: {name}/{LEGACY_FILE} is missing (tp={tp}, pp={pp}"
                        + (f", ep={ep})" if ep > 1 else ")")
                    )
                files[(t, p, e)] = ranks[numbers]
    return files


class _RankFile:
    """One legacy rank file, unpickled onto the meta device (its structure, and each
    tensor's dtype, shape and place in the zip archive `torch.save` writes); `read` reads one
    tensor's bytes into fresh memory, so the process holds only the tensors it keeps.

    torch before 2.10 says where a storage lies only for loads under a FakeTensorMode: there
    the file is memory-mapped instead (`mmap=True`), its tensors read from the mapping as
    they are merged (the pages they touch stay counted in the process's resident memory).
    """

    def __init__(self, file: Path):
        self.file = file
        self.state = safe_torch_load(file, meta=True)
        self.mapped = not _has_offsets(self.state)
        if self.mapped:
            self.state = safe_torch_load(file)
        self._size = file.stat().st_size
        try:
            with zipfile.ZipFile(file) as archive:
                order = [n for n in archive.namelist() if n.endswith("/byteorder")]
                byteorder = archive.read(order[0]).decode() if order else sys.byteorder
        except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file} is truncated or corrupt ({err})") from None
        if byteorder != sys.byteorder:
            raise CheckpointError(f"{file} was saved {byteorder}-endian: not converted")

    def _span(self, tensor: torch.Tensor, name: str) -> tuple[int, int]:
        """(file offset, element count) of the bytes `tensor` spans in its storage."""
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None:
            raise CheckpointError(f"{self.file}: {name} is not in torch.save's zip format")
        count = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        count = count if tensor.numel() else 0
        start = tensor.storage_offset() * tensor.element_size()
        end = start + count * tensor.element_size()
        if end > storage.nbytes() or offset + end > self._size:
            raise CheckpointError(
                f"{self.file} is truncated or corrupt: tensor {name} ends past its storage"
            )
        return offset + start, count

    def check(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """`tensor` of this file, once its bytes are known to lie in the file."""
        if not self.mapped:
            self._span(tensor, name)
        return tensor

    def sample(self, tensor: torch.Tensor, name: str, count: int = 4096) -> bytes:
        """The bytes of the first and last `count` elements `tensor` spans (a fingerprint)."""
        if self.mapped:
            flat = tensor.detach().reshape(-1)
            return b"".join(
                p.contiguous().view(torch.uint8).numpy().tobytes()
                for p in (flat[:count], flat[-count:])
            )
        start, total = self._span(tensor, name)
        size = tensor.element_size()
        with open(self.file, "rb") as f:
            f.seek(start)
            head = f.read(min(count, total) * size)
            f.seek(start + max(total - count, 0) * size)
            tail = f.read(min(count, total) * size)
        return head + tail

    def read(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The values of the meta `tensor` of this file (called `name` in errors)."""
        if self.mapped:
            return tensor
        start, count = self._span(tensor, name)
        flat = torch.empty(count, dtype=tensor.dtype)
        with open(self.file, "rb") as f:
            f.seek(start)
            got = f.readinto(flat.view(torch.uint8).numpy())
        if got != count * tensor.element_size():
            raise CheckpointError(f"{self.file} is truncated: tensor {name} is cut short")
        return flat.as_strided(tensor.shape, tensor.stride())


def _has_offsets(state: Any) -> bool:
    """Whether the meta tensors of a loaded rank file say where their bytes lie (torch >= 2.10;
    a file without tensors has nothing to read)."""
    model = state.get("model", state.get("model0")) if isinstance(state, dict) else None
    tensor = next((v for v in (model or {}).values() if isinstance(v, torch.Tensor)), None)
    return tensor is None or hasattr(tensor.untyped_storage(), "_checkpoint_offset")


def _read_legacy(folder: Path) -> MegatronTensors:
    found = _rank_files(folder)
    first = found[min(found)]
    opened = {first: _RankFile(first)}
    args = _args_of(opened[first].state, first)
    tp_size = _arg(args, "tensor_model_parallel_size", first, 1)
    pp_size = _arg(args, "pipeline_model_parallel_size", first, 1)
    ep_size = _arg(args, "expert_model_parallel_size", first, 1)
    etp_size = _arg(args, "expert_tensor_parallel_size", first, tp_size)
    if etp_size not in (1, tp_size):
        raise ConfigError(
            f"{first}: args.expert_tensor_parallel_size={etp_size} with tp={tp_size}: only "
            "experts split like the rest (etp = tp) or whole on every rank (etp = 1) are converted"
        )
    ranks = _layout(folder, found, tp_size, pp_size, ep_size)
    files = {key: opened.get(path) or _RankFile(path) for key, path in ranks.items()}
    num_layers = _arg(args, "num_layers", first)
    chunks = _arg(args, "virtual_pipeline_model_parallel_size", first, 1)
    if args.get("num_layers_per_virtual_pipeline_stage"):
        chunks = num_layers // pp_size // args["num_layers_per_virtual_pipeline_stage"]
    per_chunk = num_layers // pp_size // chunks
    num_experts = args.get("num_experts") or 0
    local_experts = num_experts // ep_size
    sources: dict[str, list[tuple[_RankFile, torch.Tensor]]] = {}
    meta: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}  # fingerprint of a rank's tensors -> its file
    for pp in range(pp_size):
        for ep in range(ep_size):
            rank_files = [files[(tp, pp, ep)] for tp in range(tp_size)]
            shards = [_model_chunks(f, chunks) for f in rank_files]
            for tp in range(tp_size):
                _check_distinct(rank_files[tp], shards[tp], seen)
            for chunk in range(chunks):
                offset = (chunk * pp_size + pp) * per_chunk  # Megatron's layer offset
                parts = [s[chunk] for s in shards]
                for name in parts[0]:
                    glob = _global_name(name, offset, ep * local_experts)
                    if ep > 0 and not _is_expert(glob):
                        continue  # every expert rank holds the same dense tensors
                    split = etp_size > 1 or not _is_expert(glob)
                    held = range(tp_size) if split else range(1)
                    sources[glob] = [(rank_files[tp], _shard(parts[tp], name, rank_files[tp]))
                                     for tp in held]  # fmt: skip
                    meta[glob] = _merge_tp(glob, [t.to("meta") for _, t in sources[glob]], args)

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for glob, parts in sources.items():
            yield glob, _merge_tp(glob, [file.read(t, glob) for file, t in parts], args)

    return MegatronTensors(args=args, folder=folder, meta=meta, read=read)


def _shard(part: Mapping[str, torch.Tensor], name: str, file: _RankFile) -> torch.Tensor:
    """Tensor `name` of one rank's chunk (meta), checked to lie in its file.

    Raises:
        CheckpointError: the rank file lacks it, or it lies past the file's end (named).
    """
    if name not in part:
        raise CheckpointError(f"{file.file} has no {name}, which its tensor-parallel peers hold")
    return file.check(part[name], name)


def _model_chunks(file: _RankFile, chunks: int) -> list[dict[str, torch.Tensor]]:
    """The `model` tensors (meta) of one rank file (Transformer Engine's `_extra_state`
    left out), one dict per virtual-pipeline chunk (`model0`, `model1`, ... when there are
    several)."""
    state = file.state
    keys = ["model"] if chunks == 1 else [f"model{c}" for c in range(chunks)]
    out = []
    for key in keys:
        model = state.get(key) if isinstance(state, dict) else None
        if not isinstance(model, dict):
            vpp = isinstance(state, dict) and "model0" in state
            why = (
                "virtual-pipeline chunks (model0, ...) but the args give none" if vpp
                else f"no {key!r} (the args give {chunks} virtual-pipeline chunk(s))"
            )
            raise CheckpointError(f"{file.file}: {why}")
        out.append({
            k: v for k, v in model.items()
            if isinstance(v, torch.Tensor) and not k.endswith(_SKIPPED)
        })
    return out


def _check_distinct(
    file: _RankFile, chunks: list[dict[str, torch.Tensor]], seen: dict[str, Path]
) -> None:
    """Refuse a rank file whose tensors another rank file holds too: every (tp, pp, ep) rank
    saves different shards, layers or experts, so a repeat is a file copied over another
    (which would convert silently into a wrong model). Each tensor is fingerprinted by its
    name, shape, dtype and the bytes of its first and last 4096 values (read from the file,
    not the whole tensor)."""
    import hashlib

    digest = hashlib.sha256()
    for chunk in chunks:
        for name in sorted(chunk):
            tensor = chunk[name]
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(file.sample(tensor, name))
    key = digest.hexdigest()
    if key in seen:
        raise CheckpointError(
            f"{file.file} holds the same tensors as {seen[key]}: each tensor/pipeline/expert "
            "rank saves its own shards, so one file was copied over another"
        )
    seen[key] = file.file


def _is_expert(name: str) -> bool:
    match = _LAYER.match(name)
    return bool(match and _EXPERT.match(match.group(2)))


def _global_name(name: str, offset: int, first_expert: int = 0) -> str:
    """A rank file's name with its layer numbered in the whole model (`offset` layers
    before its chunk) and its experts in the whole set (`first_expert` before its rank's),
    in one spelling `decoder.layers.L.mlp.experts.E.linear_fcN.weight`."""
    match = _LAYER.match(name)
    if not match:
        return name
    rest = match.group(2)
    local = _LOCAL_EXPERT.match(rest)
    grouped = _TE_EXPERT.match(rest)
    if local:
        rest = f"mlp.experts.{int(local.group(1)) + first_expert}.{local.group(2)}"
    elif grouped:
        rest = f"mlp.experts.{int(grouped.group(2)) + first_expert}.{grouped.group(1)}"
    return f"decoder.layers.{int(match.group(1)) + offset}.{rest}"


def _merge_tp(name: str, parts: list[torch.Tensor], args: Mapping[str, Any]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    suffix = _LAYER.match(name).group(2) if _LAYER.match(name) else name
    expert = _EXPERT.match(suffix)
    if expert:  # each expert is split over tp like the dense MLP
        suffix = f"mlp.{expert.group(2)}"
    dim = _TP_DIM.get(suffix)
    if dim is None:
        return parts[0]
    if suffix == "mlp.linear_fc1.weight" and args.get("swiglu"):
        # each rank holds [gate_r; up_r]: the whole is [gate_0..gate_n; up_0..up_n]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def _read_torch_dist(folder: Path) -> MegatronTensors:
    args = _args_of(safe_torch_load(folder / COMMON_FILE), folder / COMMON_FILE)
    metadata = read_safe_metadata(folder)
    names = {}
    for name, meta in metadata.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        wanted = name in _TOP_NAMES or name.startswith("decoder.layers.")
        if size is not None and wanted and not name.endswith(_SKIPPED):
            names[name] = name
    if not names:
        raise CheckpointError(f"{folder}: its .metadata holds no model tensors (decoder.layers.*)")
    return stored_tensors(folder, args, metadata, names)


def stored_tensors(
    folder: Path, args: dict[str, Any], metadata: Any, names: Mapping[str, str]
) -> MegatronTensors:
    """The tensors a torch_dist folder stores under the keys of `names` (key -> the
    Megatron name it holds: the optimizer's moments are stored under their weight's name
    behind a prefix), one layer (and expert) at a time: torch_dist stacks homogeneous
    layers along a leading axis (experts along a second), which is read one layer's slice
    at a time through DCP. They come layer after layer (the embedding first, the final
    norm and output layer last).

    Raises:
        CheckpointError: a layer tensor whose leading axis is not `num_layers` (named).
    """
    num_layers = _arg(args, "num_layers", folder / COMMON_FILE)
    regions: list[tuple[str, Region]] = []
    for key, name in names.items():
        meta = metadata.state_dict_metadata[key]
        dtype, shape = meta.properties.dtype, tuple(meta.size)
        for glob, offsets, sizes, whole in _unstacked(name, shape, num_layers, folder):
            regions.append((glob, Region(key, offsets, sizes, dtype), whole))
    regions.sort(key=lambda item: _reading_order(item[0]))
    reader = RegionReader(folder, {glob: region for glob, region, _ in regions})
    meta = {glob: torch.empty(whole, dtype=r.dtype, device="meta") for glob, r, whole in regions}
    budget = max(r.nbytes for r in reader.regions.values())  # one region, or a few small

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for glob, tensor in reader.items(budget=budget):
            yield glob, tensor.view(meta[glob].shape)

    return MegatronTensors(args=args, folder=folder, meta=meta, read=read)


def _unstacked(
    name: str, shape: tuple[int, ...], num_layers: int, folder: Path
) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(per-layer name, offsets, sizes, the slice's own shape) of each layer's (and
    expert's) slice of a stored tensor; a top-level or already per-layer tensor is one
    slice, the whole."""
    if name in _TOP_NAMES or _LAYER.match(name):
        yield name, (0,) * len(shape), shape, shape
        return
    if not shape or shape[0] != num_layers:
        raise CheckpointError(
            f"{folder}: {name} has shape {shape}, not {num_layers} stacked layers"
        )
    rest = name.removeprefix("decoder.layers.")
    for i in range(num_layers):
        if rest.startswith(_STACKED_EXPERTS):  # (num_layers, num_experts, ...)
            fc = rest.removeprefix(_STACKED_EXPERTS)
            for e in range(shape[1]):
                at, box = (i, e, *(0,) * (len(shape) - 2)), (1, 1, *shape[2:])
                yield f"decoder.layers.{i}.mlp.experts.{e}.{fc}", at, box, shape[2:]
        else:
            at, box = (i, *(0,) * (len(shape) - 1)), (1, *shape[1:])
            yield f"decoder.layers.{i}.{rest}", at, box, shape[1:]


def _reading_order(name: str) -> tuple[int, ...]:
    """Embedding first, then layer by layer, then the final norm and output layer."""
    if name == "embedding.word_embeddings.weight":
        return (0,)
    match = _LAYER.match(name)
    return (1, int(match.group(1))) if match else (2,)


# -- Megatron names -> Hugging Face ------------------------------------------------------------


def to_hf_tensors(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: Path
) -> dict[str, torch.Tensor]:
    """Megatron's whole tensors under Hugging Face names: the fused q/k/v un-interleaved
    (per query group [q heads | k | v]), the fused fc1 (dense or each expert's) split into
    gate and up, the router as the MoE block's gate.

    Raises:
        CheckpointError: a tensor Megatron saved that has no Hugging Face name (named).
    """
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    moe = _HF_EXPERTS.get(config["model_type"])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
            continue
        match = _LAYER.match(name)
        rest = match.group(2) if match else None
        prefix = f"model.layers.{match.group(1)}." if match else ""
        if rest in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[rest]] = tensor
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = split_qkv(tensor, heads, groups, head_dim)
            for part, t in (("q", q), ("k", k), ("v", v)):
                out[f"{prefix}self_attn.{part}_proj.{kind}"] = t
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate
            out[prefix + "mlp.up_proj.weight"] = up
        elif rest == "mlp.router.weight" and moe:
            out[prefix + f"{moe[0]}.gate.weight"] = tensor
        elif rest is not None and moe and _EXPERT.match(rest):
            expert, fc = _EXPERT.match(rest).groups()
            block, (gate_name, up_name, down_name) = moe
            at = f"{prefix}{block}.experts.{expert}."
            if fc == "linear_fc1.weight":
                gate, up = tensor.chunk(2, dim=0)
                out[at + f"{gate_name}.weight"] = gate
                out[at + f"{up_name}.weight"] = up
            else:
                out[at + f"{down_name}.weight"] = tensor
        else:
            kind = "an MoE" if moe else "a dense"
            raise CheckpointError(
                f"{source}: tensor {name} has no Hugging Face equivalent in {kind} model"
            )
    if config["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return {n: t.contiguous() for n, t in out.items()}


# model type -> (the block holding router and experts, its gate / up / down names)
_HF_EXPERTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def split_qkv(
    qkv: torch.Tensor, heads: int, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused q/k/v (rows per query group: its heads/groups q heads, one k, one v)
    -> q, k, v in Hugging Face's head order."""
    per_group = heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def write_config(folder: Path, config: Mapping[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
