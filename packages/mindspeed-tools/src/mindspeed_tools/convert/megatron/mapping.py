"""Megatron-Core's GPT tensors <-> Hugging Face's, declared once; both directions derive from it.

Every tensor Megatron-Core's GPTModel saves is one `Rule` of `RULES`: its Megatron name
(top level, or within `decoder.layers.L.`), the Hugging Face name(s) it holds, how those are
fused into it (`QKV`: per query group, its q heads then one k and one v; `GATE_UP`:
[gate; up]) and how tensor parallelism cuts it (`TPSplit`). The reader (`to_hf`: Megatron ->
Hugging Face, splitting) and the writer (`to_megatron`: Hugging Face -> Megatron, merging)
walk the same table, as do `tp_merge` (a legacy file's shards -> the whole) and `tp_split`
(the whole -> a rank's shard); a fusion's two functions are tested as inverses.

Megatron's other spellings of the same tensors live here too, read only: Transformer
Engine's layer norms fused into the next linear, the experts of a legacy rank file
(`local_experts.E.` or TE's `linear_fcN.weightE`) and torch_dist's stacking of layers
(and experts) along leading axes. They are normalised to one global spelling,
`decoder.layers.L.mlp.experts.E.linear_fcN.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import CheckpointError

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
"""A Megatron layer tensor: its layer number, then its name within the layer."""
HF_LAYER = "model.layers.{layer}."
MEGATRON_LAYER = "decoder.layers.{layer}."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
HF_EMBEDDING, HF_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
SKIPPED = ("._extra_state",)
"""Transformer Engine's per-module state: not a weight."""


@dataclass(frozen=True)
class Heads:
    """What un-fusing q/k/v needs: the query heads, the key/value groups, one head's width."""

    heads: int
    groups: int
    head_dim: int


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


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q, k, v -> Megatron's fused rows, per query group [its q heads | k | v]."""
    rest = q.shape[1:]
    parts = (t.reshape(groups, -1, *rest) for t in (q, k, v))
    return torch.cat(list(parts), dim=1).reshape(-1, *rest)


@dataclass(frozen=True)
class Fusion:
    """How one Megatron tensor holds several Hugging Face ones, both ways."""

    split: Callable[[torch.Tensor, Heads], Sequence[torch.Tensor]]
    merge: Callable[[Sequence[torch.Tensor], Heads], torch.Tensor]


QKV = Fusion(
    split=lambda t, h: split_qkv(t, h.heads, h.groups, h.head_dim),
    merge=lambda parts, h: fuse_qkv(*parts, h.groups),
)
GATE_UP = Fusion(split=lambda t, h: t.chunk(2, dim=0), merge=lambda parts, h: torch.cat(parts))


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism cuts a tensor: along `dim`, each of its `blocks` equal parts
    on its own (fc1 is [gate; up], and each rank holds [gate_r; up_r])."""

    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the Hugging Face tensors it holds. Names within a layer
    unless `top`; `{e}` is an expert's number, `{block}`/`{gate}`/`{up}`/`{down}` the
    family's names for the MoE block and its experts' linears (`EXPERT_NAMES`)."""

    megatron: str
    hf: tuple[str, ...]
    fusion: Fusion | None = None
    tp: TPSplit | None = None
    also: tuple[str, ...] = ()
    """Other Megatron spellings of the tensor, read only (Transformer Engine's fused norms)."""
    top: bool = False
    moe: bool = False

    def __post_init__(self):
        assert (self.fusion is None) == (len(self.hf) == 1), self

    def matches(self, name: str) -> re.Match | None:
        for spelling in (self.megatron, *self.also):
            found = re.fullmatch(re.escape(spelling).replace(r"\{e\}", r"(\d+)"), name)
            if found:
                return found
        return None


_COLUMN, _ROW, _GATED = TPSplit(dim=0), TPSplit(dim=1), TPSplit(dim=0, blocks=2)
_QKV_NAMES = tuple(f"self_attn.{p}_proj.{{kind}}" for p in "qkv")
RULES = (
    Rule(EMBEDDING, (HF_EMBEDDING,), tp=_COLUMN, top=True),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), top=True),
    Rule(OUTPUT, (HF_OUTPUT,), tp=_COLUMN, top=True),
    Rule(
        "input_layernorm.weight",
        ("input_layernorm.weight",),
        also=("self_attention.linear_qkv.layer_norm_weight",),
    ),
    *(
        Rule(
            f"self_attention.linear_qkv.{kind}",
            tuple(n.format(kind=kind) for n in _QKV_NAMES),
            QKV,
            tp=_COLUMN,
        )
        for kind in ("weight", "bias")
    ),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), tp=_ROW),
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    Rule(
        "pre_mlp_layernorm.weight",
        ("post_attention_layernorm.weight",),
        also=("mlp.linear_fc1.layer_norm_weight",),
    ),
    Rule(
        "mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP, tp=_GATED
    ),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), tp=_ROW),
    Rule("mlp.router.weight", ("{block}.gate.weight",), moe=True),
    Rule(
        "mlp.experts.{e}.linear_fc1.weight",
        ("{block}.experts.{e}.{gate}.weight", "{block}.experts.{e}.{up}.weight"),
        GATE_UP,
        tp=_GATED,
        moe=True,
    ),
    Rule(
        "mlp.experts.{e}.linear_fc2.weight",
        ("{block}.experts.{e}.{down}.weight",),
        tp=_ROW,
        moe=True,
    ),
)

EXPERT_NAMES = {
    "mixtral": {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen3_moe": {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
"""Hugging Face model type -> the block holding router and experts, and its experts' linears."""


def _rule_of(name: str) -> tuple[Rule, str, str | None] | None:
    """(rule, layer prefix on the Hugging Face side, expert number) of a global Megatron name."""
    match = LAYER.match(name)
    rest, prefix = (match.group(2), HF_LAYER.format(layer=match.group(1))) if match else (name, "")
    for rule in RULES:
        if rule.top == (match is None) and (found := rule.matches(rest)):
            return rule, prefix, found.group(1) if found.groups() else None
    return None


# -- Megatron -> Hugging Face (the reader) --------------------------------------------------


def to_hf_tensors(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: Path
) -> dict[str, torch.Tensor]:
    """Megatron's whole tensors (global names) under Hugging Face names (`config` is the
    Hugging Face config.json): fused tensors split, the router as the MoE block's gate; a
    tied model has no `lm_head`.

    Raises:
        CheckpointError: a tensor Megatron saved that has no Hugging Face name (named).
    """
    heads = Heads(config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    moe = EXPERT_NAMES.get(config["model_type"])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        found = _rule_of(name)
        if found is None or (found[0].moe and not moe):
            kind = "an MoE" if moe else "a dense"
            raise CheckpointError(
                f"{source}: tensor {name} has no Hugging Face equivalent in {kind} model"
            )
        rule, prefix, expert = found
        parts = rule.fusion.split(tensor, heads) if rule.fusion else (tensor,)
        for hf, part in zip(rule.hf, parts, strict=True):
            out[prefix + hf.format(e=expert, **(moe or {}))] = part
    if config["tie_word_embeddings"]:
        out.pop(HF_OUTPUT, None)
    return {n: t.contiguous() for n, t in out.items()}


# -- Hugging Face -> Megatron (the writer) ---------------------------------------------------


def to_megatron(
    hf: Mapping[str, torch.Tensor],
    heads: Heads,
    num_layers: int,
    *,
    model_type: str,
    num_experts: int = 0,
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> Megatron's whole tensors (global layer numbers): the inverse
    of `to_hf_tensors`. A tied model's output layer is its embedding (Megatron keeps one).
    A rule none of whose Hugging Face tensors exist is skipped (no qk-norm, no biases).

    Raises:
        CheckpointError: a fused tensor of which only some parts exist (named).
    """
    moe = EXPERT_NAMES.get(model_type)
    hf = {HF_OUTPUT: hf[HF_EMBEDDING], **hf} if HF_EMBEDDING in hf else dict(hf)
    rules = [r for r in RULES if moe or not r.moe]
    out: dict[str, torch.Tensor] = {}
    for rule, megatron, names in _places(rules, num_layers, num_experts, moe or {}):
        present = [n for n in names if n in hf]
        if not present:
            continue
        if len(present) < len(names):
            missing = sorted(set(names) - set(present))
            raise CheckpointError(f"{missing[0]} is missing, so {megatron} cannot be made")
        parts = [hf[n] for n in names]
        out[megatron] = rule.fusion.merge(parts, heads) if rule.fusion else parts[0]
    return out


def _places(
    rules: list[Rule], num_layers: int, num_experts: int, moe: Mapping[str, str]
) -> Iterator[tuple[Rule, str, list[str]]]:
    """(rule, global Megatron name, its Hugging Face names) of every place a rule applies:
    the top-level tensors, then layer by layer."""
    for rule in rules:
        if rule.top:
            yield rule, rule.megatron, list(rule.hf)
    for layer in range(num_layers):
        ours, theirs = MEGATRON_LAYER.format(layer=layer), HF_LAYER.format(layer=layer)
        for rule in rules:
            experts = range(num_experts) if "{e}" in rule.megatron else (None,)
            for e in experts if not rule.top else ():
                names = [theirs + n.format(e=e, **moe) for n in rule.hf]
                yield rule, ours + rule.megatron.format(e=e), names


# -- tensor parallelism ------------------------------------------------------------------------


def _tp_of(name: str) -> TPSplit | None:
    """How tensor parallelism cuts the tensor of global Megatron name `name` (None: every
    rank holds all of it)."""
    found = _rule_of(name)
    return found[0].tp if found else None


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole of tensor `name` from its tensor-parallel shards, in rank order."""
    tp = _tp_of(name)
    if len(parts) == 1 or tp is None:
        return parts[0]
    blocks = [p.chunk(tp.blocks, dim=tp.dim) for p in parts]
    whole = [torch.cat([b[i] for b in blocks], dim=tp.dim) for i in range(tp.blocks)]
    return whole[0] if tp.blocks == 1 else torch.cat(whole, dim=tp.dim)


def tp_split(name: str, tensor: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard (of `size`) of tensor `name`: `tp_merge`'s inverse."""
    tp = _tp_of(name)
    if tp is None or size == 1:
        return tensor
    blocks = tensor.chunk(tp.blocks, dim=tp.dim)
    return torch.cat([b.chunk(size, dim=tp.dim)[rank] for b in blocks], dim=tp.dim)


# -- Megatron's own spellings: experts per rank file, layers per stage, stacking ----------------

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.weight)(\d+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(linear_fc[12]\.weight)$")
STACKED_EXPERTS = "mlp.experts.experts."
"""torch_dist's experts: (layers, experts, ...) under `decoder.layers.` + this + `linear_fcN.weight`."""
TOP_NAMES = tuple(r.megatron for r in RULES if r.top)


def is_expert(name: str) -> bool:
    match = LAYER.match(name)
    return bool(match and _EXPERT.match(match.group(2)))


def global_name(name: str, offset: int, first_expert: int = 0) -> str:
    """A rank file's name with its layer numbered in the whole model (`offset` layers
    before its chunk) and its experts in the whole set (`first_expert` before its rank's),
    in one spelling `decoder.layers.L.mlp.experts.E.linear_fcN.weight`."""
    match = LAYER.match(name)
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


def stage_name(name: str, per_stage: int) -> tuple[int | None, str]:
    """(pipeline stage, name within it) of a global layer name (`global_name`'s inverse for
    even stages); (None, name) for a top-level tensor."""
    match = LAYER.match(name)
    if not match:
        return None, name
    stage, local = divmod(int(match.group(1)), per_stage)
    return stage, f"decoder.layers.{local}.{match.group(2)}"


def unstacked(
    name: str, shape: tuple[int, ...], num_layers: int, folder: Path
) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(per-layer name, offsets, sizes, the slice's own shape) of each layer's (and
    expert's) slice of a torch_dist tensor; a top-level or already per-layer tensor is one
    slice, the whole.

    Raises:
        CheckpointError: a layer tensor whose leading axis is not `num_layers` (named).
    """
    if name in TOP_NAMES or LAYER.match(name):
        yield name, (0,) * len(shape), shape, shape
        return
    if not shape or shape[0] != num_layers:
        raise CheckpointError(
            f"{folder}: {name} has shape {shape}, not {num_layers} stacked layers"
        )
    rest = name.removeprefix("decoder.layers.")
    for i in range(num_layers):
        if rest.startswith(STACKED_EXPERTS):  # (num_layers, num_experts, ...)
            fc = rest.removeprefix(STACKED_EXPERTS)
            for e in range(shape[1]):
                at, box = (i, e, *(0,) * (len(shape) - 2)), (1, 1, *shape[2:])
                yield f"decoder.layers.{i}.mlp.experts.{e}.{fc}", at, box, shape[2:]
        else:
            at, box = (i, *(0,) * (len(shape) - 1)), (1, *shape[1:])
            yield f"decoder.layers.{i}.{rest}", at, box, shape[1:]


def reading_order(name: str) -> tuple[int, ...]:
    """Embedding first, then layer by layer, then the final norm and output layer."""
    if name == EMBEDDING:
        return (0,)
    match = LAYER.match(name)
    return (1, int(match.group(1))) if match else (2,)
