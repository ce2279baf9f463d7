"""Read Hugging Face model folders and converted MindSpeed checkpoints, tensor by tensor.

A Hugging Face folder holds `config.json` and `model.safetensors` (or shards
`model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`). We read the
safetensors headers ourselves first, so a truncated or corrupt file is reported by name
before any tensor is read, and then read one tensor at a time: peak memory stays near the
largest tensor, not the model.

A converted MindSpeed checkpoint (written by `mindspeed convert --to mindspeed`) is a
folder with `mindspeed_manifest.json`, the Hugging Face `config.json` it came from, and a
DCP checkpoint `step_0/` with a `latest` pointer; a trainer's checkpoint folder
(`<run>/checkpoints` or one `step_<N>` in it) is read with the run's `config.yaml`.

Nothing here downloads: a Hub name such as `org/model` gets an error asking for a local path.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models.config import HF_MODEL_TYPES, TransformerConfig
from mindspeed_llm.models.registry import get_model_spec

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "mindspeed_manifest.json"
# safetensors dtype names <-> torch dtypes (those a checkpoint of ours can hold).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors checkpoint lives, from the file header."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


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
    if model_type not in HF_MODEL_TYPES:
        arch = ", ".join(hf.get("architectures") or []) or "none given"
        raise ConfigError(
            f"{config_path}: model_type={model_type!r} (architectures: {arch}) is not "
            f"supported; supported model types: {', '.join(sorted(HF_MODEL_TYPES))}"
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
        for name, (dtype, shape, _) in read_safetensors_header(file).items():
            if name in index:
                raise CheckpointError(f"tensor {name} is stored twice: {index[name].file}, {file}")
            index[name] = TensorInfo(file, dtype, shape)
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
        yield from read_safetensors(file, names)


def read_safetensors(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `names` of one safetensors file, one at a time (each an owned copy)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)
    except SafetensorError as err:
        raise CheckpointError(f"safetensors file {file} is unreadable: {err}") from None


def read_safetensors_header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """Name -> (dtype, shape, byte length) from a safetensors header, checking the file size.

    Raises:
        CheckpointError: the file is missing, truncated or its header is corrupt.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"safetensors file {file} is truncated ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"safetensors file {file} is truncated or corrupt (header of {header_len} "
                    f"bytes in a file of {size})"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file {file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"safetensors file {file} has a corrupt header: {err}") from None
    header.pop("__metadata__", None)
    out = {}
    end = 0
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, stop = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"safetensors file {file}: tensor {name} has an unsupported or corrupt entry "
                f"{entry!r}"
            ) from None
        out[name] = (dtype, shape, stop - start)
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"safetensors file {file} is truncated ({size} of {8 + header_len + end} bytes)"
        )
    return out


def _files_from_index(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {err}") from None
    files = []
    for name in dict.fromkeys(weight_map.values()):
        file = index_path.parent / name
        if not file.is_file():
            raise CheckpointError(f"{index_path} names {name}, which does not exist")
        files.append(file)
    return files


# -- name mapping through the family's adapter --------------------------------------------


def hf_to_ours_names(config: TransformerConfig, index: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Our name -> Hugging Face name, asking the family's `hf_adapter.from_hf` on meta tensors.

    Raises:
        CheckpointError: the adapter reports missing/unexpected tensors, or it computes a
            tensor from several (not a pure renaming; not streamable here).
    """
    meta = {
        name: torch.empty(info.shape, dtype=info.dtype, device="meta")
        for name, info in index.items()
    }
    ours = get_model_spec(config.family).hf_adapter.from_hf(meta, config)
    return _renaming(ours, meta, config.family)


def ours_to_hf_names(config: TransformerConfig, ours: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Hugging Face name -> our name, asking the family's `hf_adapter.to_hf` on `ours` (meta ok)."""
    hf = get_model_spec(config.family).hf_adapter.to_hf(ours, config)
    return _renaming(hf, ours, config.family)


def _renaming(
    out: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor], family: str
) -> dict[str, str]:
    by_id = {id(t): name for name, t in src.items()}
    mapping = {}
    for name, tensor in out.items():
        if id(tensor) not in by_id:
            raise CheckpointError(
                f"the {family!r} adapter computes {name} from several tensors; streaming "
                "conversion of such families is not supported yet"
            )
        mapping[name] = by_id[id(tensor)]
    return mapping


# -- loading a model ----------------------------------------------------------------------


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[nn.Module, TransformerConfig]:
    """Build a model and load its weights from a Hugging Face folder or a MindSpeed checkpoint.

    Args:
        path: a Hugging Face folder (config.json + safetensors), a converted MindSpeed
            checkpoint (with mindspeed_manifest.json), or a trainer checkpoint folder
            (`<run>/checkpoints` or a `step_<N>` in it).
        device: where the model lives.
        dtype: parameter dtype; None keeps the stored one (`config.dtype` when the source
            names it, else float32).
        overrides: fields of `TransformerConfig` (e.g. `ops_impl="reference"`).

    Returns:
        (model in eval mode, its config).

    Raises:
        ConfigError / CheckpointError: see `read_hf_config`, `hf_tensor_index`.
    """
    from mindspeed_llm.models import checkpoint_io

    folder = local_dir(path)
    if checkpoint_io.is_mindspeed_checkpoint(folder):
        config = checkpoint_io.read_checkpoint_config(folder, **overrides)
        model = _empty_model(config, device, dtype)
        checkpoint_io.load_model_weights(model, checkpoint_io.resolve_step_dir(folder))
        return model.eval(), config
    config = read_hf_config(folder, **overrides)
    model = _empty_model(config, device, dtype)
    load_hf_weights(model, folder, config)
    return model.eval(), config


def load_hf_weights(model: nn.Module, path: str | Path, config: TransformerConfig) -> None:
    """Copy the weights of Hugging Face folder `path` into `model` (plain tensors), one at a time.

    Raises:
        CheckpointError: a tensor is missing, extra, or of the wrong shape.
    """
    index = hf_tensor_index(path)
    names = hf_to_ours_names(config, index)
    targets = model.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(names))
    if missing:
        raise CheckpointError(
            f"{path}: the model has tensors the adapter does not map: {missing[:5]}"
        )
    wanted: dict[str, list[str]] = {}
    for ours, hf in names.items():
        wanted.setdefault(hf, []).append(ours)
    with torch.no_grad():
        for hf_name, tensor in iter_hf_tensors(path):
            for ours in wanted.get(hf_name, ()):
                target = targets[ours]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"{path}: {hf_name} has shape {tuple(tensor.shape)} but the model's "
                        f"{ours} is {tuple(target.shape)}"
                    )
                target.copy_(tensor)


def _empty_model(
    config: TransformerConfig, device: str | torch.device, dtype: torch.dtype | None
) -> nn.Module:
    """The family's model, materialised on `device` (weights to be overwritten)."""
    spec = get_model_spec(config.family)
    if dtype is None and config.dtype is not None:
        dtype = getattr(torch, config.dtype, None)
    with torch.device("meta"):
        model = spec.build(config)
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device)
    # Recomputes the RoPE tables (in fp32, whatever `dtype`); the weights are replaced.
    model.init_weights(buffer_device=torch.device(device))
    return model
