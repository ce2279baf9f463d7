"""Read Hugging Face model folders tensor by tensor, under our names.

A Hugging Face folder holds `config.json` and `model.safetensors` (or shards
`model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`). Every file's
safetensors header is checked first (`mindspeed_core.checkpoint.safetensors`), so a
truncated or corrupt file is reported by name before any tensor is read; then tensors are
read one at a time: peak memory stays near the largest tensor, not the model. The family's
`hf_adapter` maps the names both ways.

Loading a whole model (from this or a MindSpeed checkpoint) is `mindspeed_llm.loading`. Nothing
here downloads: a Hub name such as `org/model` gets an error asking for a local path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mindspeed_core.checkpoint.safetensors import (
    TensorInfo,
    read_safetensors_header,
    read_tensor,
    read_tensor_block,
)
from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.parallel.materialize import Box, plain_name, write_box
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import model_types
from mindspeed_llm.models.registry import get_model_spec
from mindspeed_llm.models.weight_check import check_weights

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# -- paths --------------------------------------------------------------------------------


def local_dir(path: str | Path, what: str = "model") -> Path:
    """`path` as an existing local folder.

    Raises:
        ConfigError: it does not exist (a Hub name gets a hint to download it first) or
            is not a folder.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"{what} path {p} is a file; give the folder that holds it")
    if _HUB_NAME.match(str(path)) and not str(path).startswith((".", "/")):
        raise ConfigError(
            f"{what} path {path!r} does not exist locally and looks like a Hugging Face Hub "
            "name; MindSpeed never downloads: fetch it first (e.g. `huggingface-cli download "
            f"{path} --local-dir DIR`) and pass the local folder"
        )
    raise ConfigError(f"{what} path {p} does not exist")


# -- Hugging Face folders -----------------------------------------------------------------


def read_hf_config(path: str | Path, **overrides: Any) -> TransformerConfig:
    """The `TransformerConfig` of the Hugging Face folder `path` (its `config.json`).

    `overrides` set our own fields (e.g. `ops_impl="reference"`).

    Raises:
        ConfigError: no such folder, no config.json, unreadable JSON, or an architecture
            we do not build (the message lists the supported ones).
    """
    folder = local_dir(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError(
            f"{folder} has no {CONFIG_FILE}: not a Hugging Face model folder "
            "(or a converted MindSpeed checkpoint)"
        )
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    model_type = hf.get("model_type")
    if model_type not in model_types():
        arch = ", ".join(hf.get("architectures") or []) or "none given"
        raise ConfigError(
            f"{config_path}: model_type={model_type!r} (architectures: {arch}) is not "
            f"supported; supported model types: {', '.join(model_types())}"
        )
    try:
        config = TransformerConfig.from_hf(hf, **overrides)
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}") from None
    get_model_spec(config.family)  # the family must be registered
    return config


def hf_tensor_index(path: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, dtype, shape) of every tensor of a Hugging Face folder, from headers only.

    Raises:
        CheckpointError: no safetensors weights, an index naming a missing file, or a
            truncated/corrupt safetensors file (named).
    """
    folder = local_dir(path)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        files = _files_from_index(index_path)
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(found) == 1:
            files = [folder / found[0]]
        else:
            bins = sorted(p.name for p in folder.glob("*.bin"))
            hint = f" (found {', '.join(bins)}: save with safe_serialization=True)" if bins else ""
            raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    index: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name in index:
                raise CheckpointError(f"tensor {name} is stored twice: {index[name].file}, {file}")
            index[name] = info
    return index


def iter_hf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (Hugging Face name, tensor) from a folder's safetensors, one tensor at a time.

    Tensors come file by file in the order of each file's header; every file is checked
    (headers, sizes) before the first tensor is yielded.

    Raises:
        CheckpointError: see `hf_tensor_index`.
    """
    index = hf_tensor_index(path)
    by_file: dict[Path, list[str]] = {}
    for name, info in index.items():
        by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        with open(file, "rb") as f:
            for name in names:
                yield name, read_tensor(index[name], f)


def _files_from_index(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {err}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: weight_map must be an object of name -> file")
    files = []
    for name in dict.fromkeys(weight_map.values()):
        file = index_path.parent / _inside_folder(index_path, name)
        if not file.is_file():
            raise CheckpointError(f"{index_path} names {name}, which does not exist")
        files.append(file)
    return files


def _inside_folder(index_path: Path, name: Any) -> str:
    """`name` from a weight_map, refused unless it is a plain relative path that stays in
    the model folder (an index must not make us read /etc/passwd or ../other_model)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{index_path} names an invalid shard file {name!r}")
    parts = Path(name).parts
    if Path(name).is_absolute() or "\\" in name or any(p == ".." for p in parts):
        raise CheckpointError(
            f"{index_path} names the shard file {name!r}, which lies outside the model folder"
        )
    return name


# -- name mapping through the family's adapter --------------------------------------------


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (`model.layers.3.mlp...` -> 3), None outside layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _meta(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}


class HFWeights:
    """The tensors of a Hugging Face folder under our names, read one at a time, or one
    rank's block of one at a time (`read`).

    The family's `hf_adapter.from_hf`, run once on meta tensors, tells which of our tensors
    are renamed Hugging Face tensors (a block of one is read from the file alone) and which
    it computes from several: stacked experts the adapter lists in `expert_sources` are read
    one expert's block at a time; the rest (fused q/k/v, permuted rows) are computed one
    layer at a time, from that layer's tensors only.

    Raises:
        CheckpointError: the adapter reports missing or unexpected tensors.
    """

    def __init__(self, path: str | Path, config: TransformerConfig):
        self.path = Path(path)
        self.config = config
        self.index = hf_tensor_index(path)
        self._adapter = get_model_spec(config.family).hf_adapter
        meta = _meta(self.index)
        ours = self._adapter.from_hf(meta, config)
        by_id = {id(t): name for name, t in meta.items()}
        self.shapes = {n: (t.dtype, tuple(t.shape)) for n, t in ours.items()}
        """Our name -> (dtype, shape) as stored."""
        self.renamed = {n: by_id[id(t)] for n, t in ours.items() if id(t) in by_id}
        """Our name -> the Hugging Face tensor it is."""
        sources = getattr(self._adapter, "expert_sources", None)
        found = sources(config, frozenset(self.index)) if sources is not None else {}
        self.experts = {n: hf for n, hf in found.items() if self._stacks(n, hf)}
        """Our stacked expert tensor -> the per-expert (out, in) tensors it stacks."""
        self._cache: dict[str, torch.Tensor] = {}

    def _stacks(self, name: str, hf: list[str]) -> bool:
        """Whether `name` is `hf` stacked, each transposed (else it is computed by layer)."""
        if name not in self.shapes or not all(h in self.index for h in hf):
            return False
        _, (num, fan_in, fan_out) = self.shapes[name]
        return num == len(hf) and all(self.index[h].shape == (fan_out, fan_in) for h in hf)

    def get(self, name: str) -> torch.Tensor:
        """Our tensor `name` (a fresh CPU tensor)."""
        if name in self.renamed:
            return read_tensor(self.index[self.renamed[name]])
        if name in self.experts:
            shape = self.shapes[name][1]
            return self._expert_block(name, Box((0,) * len(shape), shape))
        if name not in self._cache:
            self._cache.update(self._compute(layer_of(name)))
        return self._cache.pop(name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The block `box` of our tensor `name` (CPU, stored dtype): only that block's bytes
        of a renamed tensor or of each stacked expert in it; a computed tensor is made whole
        from its layer's tensors first (kept until read, so each is made once)."""
        if name in self.renamed:
            return read_tensor_block(self.index[self.renamed[name]], box.offsets, box.sizes)
        if name in self.experts:
            return self._expert_block(name, box)
        if name not in self._cache:
            self._cache.update(self._compute(layer_of(name)))
        return box.of(self._cache[name]).clone()

    def done(self) -> None:
        """Drop the computed tensors kept for `read`."""
        self._cache.clear()

    def _expert_block(self, name: str, box: Box) -> torch.Tensor:
        first, count = box.offsets[0], box.sizes[0]
        (row, col), (rows, cols) = box.offsets[1:], box.sizes[1:]  # (in, out) per expert
        blocks = [
            read_tensor_block(self.index[hf], (col, row), (cols, rows)).t()
            for hf in self.experts[name][first : first + count]
        ]
        dtype = self.shapes[name][0]
        return torch.stack(blocks) if blocks else torch.empty(box.sizes, dtype=dtype)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (our name, tensor): renamed ones in file order, then computed ones by layer."""
        by_hf: dict[str, list[str]] = {}
        for ours, hf in self.renamed.items():
            by_hf.setdefault(hf, []).append(ours)
        for hf_name, tensor in iter_hf_tensors(self.path):
            for ours in by_hf.get(hf_name, ()):
                yield ours, tensor
        computed = [n for n in self.shapes if n not in self.renamed]
        for name in sorted(computed, key=lambda n: (layer_of(n) or -1, n)):
            yield name, self.get(name)

    def _compute(self, layer: int | None, *, all_of_layer: bool = False) -> dict[str, torch.Tensor]:
        """The computed tensors of one layer, from that layer's Hugging Face tensors alone:
        first only those no tensor of ours is a renamed copy of, then, where that is not
        enough, all of them."""
        mixed: dict[str, torch.Tensor] = _meta(self.index)
        skipped = set(self.renamed.values()) | {h for hs in self.experts.values() for h in hs}
        for name, info in self.index.items():
            if layer_of(name) == layer and (all_of_layer or name not in skipped):
                mixed[name] = read_tensor(info)
        out = {}
        for name, tensor in self._adapter.from_hf(mixed, self.config).items():
            if name in self.renamed or name in self.experts or layer_of(name) != layer:
                continue
            if tensor.is_meta and not all_of_layer:
                return self._compute(layer, all_of_layer=True)
            if tensor.is_meta:
                raise CheckpointError(
                    f"the {self.config.family!r} adapter builds {name} from tensors of other "
                    "layers; it cannot be converted one layer at a time"
                )
            out[name] = tensor
        return out


def to_hf_plan(
    config: TransformerConfig, ours: Mapping[str, Any]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
    """What the family's `hf_adapter.to_hf` makes of our tensors, without reading any.

    Args:
        ours: our name -> anything with .shape and .dtype (e.g. checkpoint metadata).

    Returns:
        (Hugging Face name -> (dtype, shape) of every tensor to write, Hugging Face name ->
        our name for those that are only renamed; the others are computed, see `to_hf_one`).

    Raises:
        CheckpointError: the adapter reports missing or unexpected tensors.
    """
    meta = _meta(ours)
    by_id = {id(t): name for name, t in meta.items()}
    out = get_model_spec(config.family).hf_adapter.to_hf(meta, config)
    shapes = {hf: (t.dtype, tuple(t.shape)) for hf, t in out.items()}
    return shapes, {hf: by_id[id(t)] for hf, t in out.items() if id(t) in by_id}


def to_hf_one(
    config: TransformerConfig, ours: Mapping[str, Any], name: str, tensor: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The computed Hugging Face tensors made from our tensor `name` alone (e.g. the
    per-expert weights of a stacked expert tensor); the others stay meta and are dropped."""
    return to_hf_some(config, ours, {name: tensor})


def to_hf_some(
    config: TransformerConfig, ours: Mapping[str, Any], real: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The computed Hugging Face tensors made from our tensors `real` (e.g. a fused q/k/v
    weight, made once its three parts are all real); the others stay meta and are dropped."""
    adapter = get_model_spec(config.family).hf_adapter
    probe = _meta(ours)
    probe.update(real)
    return {hf: t for hf, t in adapter.to_hf(probe, config).items() if not t.is_meta}


def check_hf_weights(model: nn.Module, path: str | Path, config: TransformerConfig) -> HFWeights:
    """The weights of Hugging Face folder `path`, checked against `model` (the plain model
    `config` builds; meta is fine): every tensor of the model is there with its shape.

    Raises:
        CheckpointError: a tensor is missing, extra, or of the wrong shape (naming the
            folder and the tensor).
    """
    weights = HFWeights(path, config)
    targets = model.state_dict(keep_vars=True)
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in targets.items()}
    check_weights(path, weights.shapes, expected, weights.renamed)
    missing = sorted(set(targets) - set(weights.shapes))
    if missing:
        raise CheckpointError(f"{path}: the model has tensors the checkpoint lacks: {missing[:5]}")
    return weights


def read_hf_weights(
    parts: Sequence[nn.Module], weights: HFWeights, names: Collection[str] | None = None
) -> set[str]:
    """Fill this rank's shard of every parameter and saved buffer of `parts` (materialised,
    possibly parallelised) that `weights` holds, one block at a time (`HFWeights.read`);
    `names` limits it to those (plain names). Returns the names filled.

    Padding rows (a vocabulary padded for tensor parallel) are zero. A tied copy (the
    last pipeline stage's output projection) reads the embedding it copies.
    """
    filled = set()
    with torch.no_grad():
        for part in parts:
            for name, tensor in _loadable(part):
                if name not in weights.shapes or (names is not None and name not in names):
                    continue
                _fill(tensor, weights, name)
                filled.add(name)
    weights.done()
    return filled


def load_hf_weights(model: nn.Module, path: str | Path, config: TransformerConfig) -> None:
    """Copy the weights of Hugging Face folder `path` into `model` (plain tensors or this
    rank's shards), one block at a time.

    Raises:
        CheckpointError: a tensor is missing, extra, or of the wrong shape.
    """
    read_hf_weights([model], check_hf_weights(model, path, config))


def _loadable(part: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, tensor) of the parameters and persistent buffers of `part`."""
    for name, tensor in part.state_dict(keep_vars=True).items():
        yield plain_name(name), tensor


def _fill(tensor: torch.Tensor, weights: HFWeights, name: str) -> None:
    stored_rows = weights.shapes[name][1][0] if weights.shapes[name][1] else None

    def read(box: Box) -> torch.Tensor:
        if stored_rows is None or box.offsets[0] + box.sizes[0] <= stored_rows:
            return weights.read(name, box)
        out = torch.zeros(box.sizes, dtype=weights.shapes[name][0])  # padding rows
        real = max(0, stored_rows - box.offsets[0])
        if real:
            inside = Box(box.offsets, (real, *box.sizes[1:]))
            out[:real] = weights.read(name, inside)
        return out

    write_box(tensor, read)
