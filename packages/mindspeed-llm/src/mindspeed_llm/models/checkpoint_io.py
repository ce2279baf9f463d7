"""Find and read the model of a MindSpeed checkpoint: a converted one or a trainer's.

Two kinds of folders hold a model's DCP checkpoint:

- converted (`mindspeed convert --to mindspeed`)::

      OUT/mindspeed_manifest.json   family, our model config, layout it was validated for
      OUT/config.json ...           the Hugging Face config, generation config, tokenizer
      OUT/step_0/                   DCP: the `model` state under ModelState's names
      OUT/latest                    "step_0"

- a trainer run: `<run>/checkpoints/step_<N>/` and `<run>/checkpoints/latest`, with the
  model section in `<run>/config.yaml`.

Step folders and `latest` are named as `mindspeed_core.checkpoint.steps` parses them;
`mindspeed_llm.loading` decides once which kind a folder is and loads its model.

DCP keeps each tensor under its fully-qualified name with its global shape, whatever the
layout it was saved from, so one checkpoint loads under any tp/pp/ep layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from mindspeed_core.checkpoint import LATEST, ModelState, load_dcp
from mindspeed_core.checkpoint.steps import checkpoint_root, parse_step
from mindspeed_core.checkpoint.verify import check_files, check_states, read_metadata
from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_io import CONFIG_FILE, read_hf_config
from mindspeed_llm.models.registry import build_model_config

MODEL_KEY = "model"
"""The name the trainer (and convert) give the model state inside a checkpoint."""
MANIFEST_FILE = "mindspeed_manifest.json"
MANIFEST_FORMAT = "mindspeed-checkpoint"
MANIFEST_VERSION = 1


def is_mindspeed_checkpoint(folder: Path) -> bool:
    """A converted checkpoint, a trainer checkpoint folder, or one step_<N> in it."""
    return (
        (folder / MANIFEST_FILE).is_file()
        or (folder / LATEST).is_file()
        or (parse_step(folder) is not None and (folder / ".metadata").is_file())
    )


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of a converted checkpoint, or None for a trainer's."""
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not a MindSpeed checkpoint manifest")
    return manifest


def run_config_path(folder: Path) -> Path | None:
    """`config.yaml` of the trainer run whose checkpoints are in `folder`, if there is one."""
    root = checkpoint_root(folder)
    for candidate in (root.parent / "config.yaml", root / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


def run_config(folder: Path) -> dict[str, Any] | None:
    """The resolved config of the trainer run whose checkpoints are in `folder` (its
    config.yaml as a dict), or None when there is no run next to it: the one reader of a
    run's saved config.

    Raises:
        ConfigError: the file is not YAML (naming it and the line).
    """
    from mindspeed_core.config import read_yaml

    path = run_config_path(folder)
    return None if path is None else read_yaml(path)[0] or {}


def read_checkpoint_config(folder: Path, **overrides: Any) -> TransformerConfig:
    """The model config of a MindSpeed checkpoint folder (converted or a trainer's).

    Raises:
        ConfigError: neither a manifest nor the run's config.yaml is found.
    """
    root = checkpoint_root(folder)
    manifest = read_manifest(root)
    if manifest is not None:
        fields = {**manifest["model_config"], **overrides}
        return TransformerConfig(**fields)
    data = run_config(folder)
    if data is None:
        raise ConfigError(
            f"checkpoint {folder} has no {MANIFEST_FILE} and no run config.yaml next to it; "
            "cannot tell which model it holds"
        )
    return model_config_from_run(data, **overrides)


def model_config_from_run(data: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """The model a trainer run built, from the `model` section of its config (`run_config`)."""
    model = data.get("model") or {}
    overrides = {"ops_impl": model.get("ops_impl", "auto"), **overrides}
    if model.get("hf_path"):
        return read_hf_config(model["hf_path"], **overrides)
    family = model.get("family", "llama")
    if model.get("hf_config"):
        return build_model_config(family, hf_config=model["hf_config"], **overrides)
    return build_model_config(family, model.get("flavor") or "debug", **overrides)


def hf_source_dir(folder: Path) -> Path | None:
    """A folder holding the Hugging Face config.json (and tokenizer files) this model came from."""
    root = checkpoint_root(folder)
    if (root / CONFIG_FILE).is_file():
        return root
    data = run_config(folder)
    if data is None:
        return None
    model = data.get("model") or {}
    for key in ("hf_path", "hf_config"):
        if model.get(key):
            path = Path(model[key])
            path = path if path.is_dir() else path.parent
            if (path / CONFIG_FILE).is_file():
                return path
    return None


def run_tokenizer(folder: Path) -> Path | None:
    """The tokenizer (file or folder) the trainer run of `folder` trained with, if it named one."""
    data = run_config(folder)
    if data is None:
        return None
    path = (data.get("data") or {}).get("tokenizer") or (data.get("model") or {}).get("hf_path")
    return Path(path) if path and Path(path).exists() else None


def tensor_metadata(step_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Our name -> (dtype, global shape) of every model tensor in a DCP checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(step_dir)
    check_files(step_dir, metadata)
    prefix = MODEL_KEY + "."
    return {
        key[len(prefix) :]: (meta.properties.dtype, tuple(meta.size))
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def saved_states(step_dir: Path) -> set[str]:
    """Names of the states a DCP checkpoint holds ("model", "optimizer", ...); empty when
    `step_dir` is not a complete checkpoint (the caller's own load reports that)."""
    if not (step_dir / ".metadata").is_file():
        return set()
    keys = read_metadata(step_dir).state_dict_metadata
    return {key.split(".", 1)[0] for key in keys}


def read_tensors(step_dir: Path, names: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
    """Load the model tensors `names` (name -> dtype, shape) from a DCP checkpoint, as plain tensors."""
    state = {MODEL_KEY: {n: torch.empty(shape, dtype=dtype) for n, (dtype, shape) in names.items()}}
    load_dcp(state, step_dir, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return state[MODEL_KEY]


def load_model_weights(model: nn.Module | list[nn.Module], step_dir: Path) -> None:
    """Load the `model` state of DCP checkpoint `step_dir` into a (possibly parallelised) model.

    Only the model is read; a checkpoint holding optimizer state too is fine.

    Raises:
        CheckpointError: incomplete checkpoint or one of another model.
    """
    state = {MODEL_KEY: ModelState(model)}
    metadata = read_metadata(step_dir)
    check_files(step_dir, metadata)
    check_states(step_dir, metadata, state)
    load_dcp(state, step_dir)  # runs no code from the files; checks records it reads


def config_fields(config: TransformerConfig) -> dict[str, Any]:
    """Our config as JSON-ready fields (for the manifest); a padded vocabulary is left
    out: checkpoints hold vocab_size rows whatever the layout padded."""
    fields = dataclasses.asdict(config)
    fields.pop("padded_vocab_size", None)
    return fields
