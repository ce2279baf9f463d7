"""Load a model from wherever it lives: a Hugging Face folder, a converted MindSpeed
checkpoint, or a trainer run's checkpoints.

    from mindspeed_llm.loading import load_model, resolve_model_source
    from mindspeed_llm.tokenizer import load_tokenizer

    source = resolve_model_source("runs/demo/checkpoints")  # what the folder is, once
    model, config = load_model(source, device="cpu")
    tokenizer = load_tokenizer(source.tokenizer)

`resolve_model_source` decides once which kind of folder it is and finds everything
that belongs to the model (config, weights, tokenizer, the Hugging Face files it came
with); `load_model` builds the family's model and reads the weights into it, tensor by
tensor from safetensors or from DCP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mindspeed_core.checkpoint import LATEST
from mindspeed_core.checkpoint.steps import checkpoint_root, resolve
from mindspeed_core.errors import CheckpointError
from mindspeed_core.parallel.materialize import materialize
from mindspeed_llm.demo import cache_root, ensure_demo_data
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_io import check_hf_weights, local_dir, read_hf_config
from mindspeed_llm.models.startup import base_shapes, build_meta, fill_parts
from mindspeed_llm.peft import checkpoint as adapters
from mindspeed_llm.peft.lora import merge_lora

KINDS = ("hf", "converted", "run")


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Everything that belongs to one model folder, resolved once."""

    kind: str
    """"hf": a Hugging Face folder; "converted": written by `mindspeed convert --to
    mindspeed`; "run": a trainer's checkpoints folder or one step_<N> in it."""
    path: Path
    """The folder as given."""
    config: TransformerConfig
    """The model it holds."""
    weights: Path
    """Where the weights are: the Hugging Face folder, or the DCP step folder to read."""
    tokenizer: Path
    """For `load_tokenizer`: the folder when it holds tokenizer files, else the tokenizer
    the run trained with, else the folder (whose load then names what is missing)."""
    hf_dir: Path | None
    """The folder with the Hugging Face files the model came with (config.json,
    generation_config.json, tokenizer and chat template); None for a run started
    from a named flavor."""


def resolve_model_source(path: str | Path, **overrides: Any) -> ModelSource:
    """What the folder `path` holds (see `ModelSource`); `overrides` set fields of the
    model config (e.g. `ops_impl="reference"`).

    Raises:
        ConfigError / CheckpointError: no such folder, not a model, an unsupported
            architecture, or a checkpoint whose model cannot be told.
    """
    folder = local_dir(path)
    if ckpt.is_mindspeed_checkpoint(folder):
        return _checkpoint_source(folder, overrides)
    config = read_hf_config(folder, **overrides)
    return ModelSource(
        kind="hf", path=folder, config=config, weights=folder, tokenizer=folder, hf_dir=folder
    )


def checkpoint_source(path: str | Path, **overrides: Any) -> ModelSource:
    """`resolve_model_source` for a MindSpeed checkpoint only (converted or a run's).

    Raises:
        CheckpointError: `path` is not a MindSpeed checkpoint or is incomplete.
    """
    folder = local_dir(path, "checkpoint")
    if not ckpt.is_mindspeed_checkpoint(folder):
        raise CheckpointError(
            f"{folder} is not a MindSpeed checkpoint (no {ckpt.MANIFEST_FILE}, {LATEST} or "
            ".metadata)"
        )
    return _checkpoint_source(folder, overrides)


def load_model(
    source: ModelSource | str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    parallelize: Callable[[nn.Module], Any] | None = None,
    **overrides: Any,
) -> tuple[nn.Module, TransformerConfig]:
    """Build a model and load its weights from a Hugging Face folder or a MindSpeed checkpoint.

    The model is built on the meta device and (with `parallelize`) split before anything is
    allocated; then each tensor's block this process holds is read alone, so a process never
    holds more than its share of the model plus one tensor.

    Args:
        source: a `ModelSource`, or a folder for `resolve_model_source`: a Hugging Face
            folder (config.json + safetensors), a converted MindSpeed checkpoint (with
            mindspeed_manifest.json), or a trainer checkpoint folder (`<run>/checkpoints`
            or a `step_<N>` in it).
        device: where the model lives.
        dtype: parameter dtype; None keeps the stored one (`config.dtype` when the source
            names it, else float32).
        parallelize: applied to the meta model first (e.g. tensor parallel for
            `generate --tp`); a LoRA run's adapters are merged into its base whole first.
        overrides: fields of `TransformerConfig` (e.g. `ops_impl="reference"`).

    Returns:
        (model in eval mode, its config).

    Raises:
        ConfigError / CheckpointError: see `resolve_model_source`; a tensor is missing,
            extra or of the wrong shape.
    """
    if not isinstance(source, ModelSource):
        source = resolve_model_source(source, **overrides)
    elif overrides:
        source = dataclasses.replace(source, config=dataclasses.replace(source.config, **overrides))
    config = source.config
    if dtype is None and config.dtype is not None:
        dtype = getattr(torch, config.dtype, None)
    model = build_meta(config)
    lora = _run_lora(source)
    if lora is not None:  # adapters only: the base + them, merged (whole, then split)
        model = _empty_model(config, device, dtype)
        adapters.load_adapter_weights(model, source.path, source.weights, config, lora)
        merge_lora(model)
        if parallelize is not None:
            parallelize(model)
        return model.eval(), config
    weights = check_hf_weights(model, source.weights, config) if source.kind == "hf" else None
    base = base_shapes(model)
    if parallelize is not None:
        parallelize(model)
    if weights is not None:
        fill_parts([model], device, seed=0, weights=weights, base=base, dtype=dtype)
    else:  # a DCP checkpoint: reads this process's blocks of each tensor (resharding)
        materialize(model, device, dtype=dtype)
        model.init_weights(buffer_device=torch.device(device), seed=0, skip=base)
        ckpt.load_model_weights(model, source.weights)
    return model.eval(), config


def _run_lora(source: ModelSource):
    """The `lora` section of a LoRA run's checkpoints (None otherwise)."""
    if source.kind != "run":
        return None
    return adapters.run_lora(source.path)


def _checkpoint_source(folder: Path, overrides: dict[str, Any]) -> ModelSource:
    root = checkpoint_root(folder)
    kind = "converted" if (root / ckpt.MANIFEST_FILE).is_file() else "run"
    return ModelSource(
        kind=kind,
        path=folder,
        config=ckpt.read_checkpoint_config(folder, **overrides),
        weights=resolve(folder),
        tokenizer=_checkpoint_tokenizer(folder, root),
        hf_dir=ckpt.hf_source_dir(folder),
    )


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or any(folder.glob("*.model"))


def _checkpoint_tokenizer(folder: Path, root: Path) -> Path:
    """The checkpoint's own tokenizer files, else the tokenizer its run trained with
    (`data.tokenizer` or `model.hf_path` in the run's config.yaml, or the demo's when the
    run used `mindspeed pretrain`'s demo corpus), else `folder`."""
    for candidate in (folder, root):
        if _has_tokenizer(candidate):
            return candidate
    tokenizer = ckpt.run_tokenizer(folder)
    run = ckpt.run_config(folder)
    if tokenizer is None and run is not None:
        data = run.get("data") or {}
        if not data.get("paths") and not data.get("tokenizer"):  # the demo corpus
            tokenizer = ensure_demo_data(cache_root()).tokenizer
    return tokenizer or folder


def _empty_model(
    config: TransformerConfig, device: str | torch.device, dtype: torch.dtype | None
) -> nn.Module:
    """The family's model, materialised on `device` (buffers computed; weights to be
    overwritten)."""
    model = build_meta(config)
    names = base_shapes(model)
    materialize(model, device, dtype=dtype)
    # Computes the RoPE tables (in fp32, whatever `dtype`); the weights are read later.
    model.init_weights(buffer_device=torch.device(device), seed=0, skip=names)
    return model
