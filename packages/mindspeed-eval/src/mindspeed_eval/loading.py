"""Load the model to evaluate: the one place mindspeed-eval reads weights and tokenizers.

`load_for_eval(path)` takes a Hugging Face folder, a converted MindSpeed checkpoint or a
trainer run's checkpoints folder (`runs/x/checkpoints` or one `step_<N>` in it), finds
its tokenizer, and returns the model in eval mode. Under torchrun with `tp > 1` the model
is tensor parallel over groups of `tp` neighbouring ranks (logits replicated); the other
axis is data parallel: each group scores its own share of the requests (`EvalMesh`).

Model and tokenizer lookup are mindspeed-llm's (`mindspeed_llm.loading`), the
same as `mindspeed generate`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mindspeed_core.errors import ConfigError, DataError, ParallelError
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.tokenizer import Tokenizer

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EvalMesh:
    """Which share of the work this process does: data-parallel rank and size over groups
    of `tp` ranks that hold one tensor-parallel copy of the model."""

    dp_rank: int = 0
    dp_size: int = 1
    tp: int = 1
    dp_group: object | None = None
    """Process group of the ranks with this rank's tp index (None: one group)."""

    @property
    def is_main(self) -> bool:
        """The process that prints and writes (global rank 0)."""
        return not dist.is_initialized() or dist.get_rank() == 0


@dataclass
class LoadedModel:
    """A model ready to score, with what scoring needs to know about it."""

    model: nn.Module
    config: TransformerConfig
    tokenizer: Tokenizer
    folder: Path
    """The model folder given (an HF folder or a checkpoint folder)."""
    device: torch.device
    mesh: EvalMesh


def load_for_eval(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str = "auto",
    tp: int = 1,
) -> LoadedModel:
    """The model at `path` and its tokenizer, in eval mode, sharded if `tp > 1`.

    Args:
        path: HF folder, converted checkpoint, or a run's checkpoints (or step) folder.
        tokenizer: tokenizer file or folder (default: found next to the model).
        device: "auto", "cpu", "cuda" or "npu".
        dtype: "auto" (as stored), "fp32", "bf16" or "fp16".
        tp: tensor-parallel degree; > 1 needs torchrun with a world size divisible by it.

    Raises:
        ConfigError / CheckpointError / DataError: not a model folder, no tokenizer, or a
            tokenizer larger than the model's vocabulary (the message names the folder).
    """
    from mindspeed_core import device as dev

    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    mesh = _mesh(tp)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_t = dev.get_device(
        local_rank, dev.detect_device_type(None if device == "auto" else device)
    )
    split = (lambda model: _tensor_parallel(model, tp)) if tp > 1 else None  # on meta: shards only
    model, config, tok, folder = _read_model(path, tokenizer, device_t, DTYPES[dtype], split)
    if tok.vocab_size > config.vocab_size:
        raise DataError(
            f"tokenizer {tok.path} has {tok.vocab_size} tokens but the model {folder} only "
            f"{config.vocab_size}: not the model's tokenizer?"
        )
    return LoadedModel(model, config, tok, folder, device_t, mesh)


def _read_model(path, tokenizer, device: torch.device, dtype: torch.dtype | None, split=None):
    """(model, config, tokenizer, folder): the single call into llm's loading (`split`
    parallelises the model on the meta device, before its shards are read)."""
    from mindspeed_llm.loading import load_model, resolve_model_source
    from mindspeed_llm.tokenizer import load_tokenizer

    source = resolve_model_source(path)  # a folder that is no model fails here
    tok = load_tokenizer(tokenizer or source.tokenizer)
    model, config = load_model(source, device=device, dtype=dtype, parallelize=split)
    return model, config, tok, source.path


def _mesh(tp: int) -> EvalMesh:
    """Start the process group under torchrun and split the ranks into dp x tp."""
    if tp < 1:
        raise ConfigError(f"tp must be at least 1, got {tp}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if tp > 1:
            raise ParallelError(f"tp={tp} needs {tp} processes: launch with torchrun")
        return EvalMesh()
    if world % tp:
        raise ParallelError(f"tp={tp} does not divide the {world} processes torchrun started")
    if not dist.is_initialized():
        from mindspeed_core.distributed import init_distributed

        init_distributed()
    rank = dist.get_rank()
    dp_size = world // tp
    groups = [dist.new_group([d * tp + t for d in range(dp_size)]) for t in range(tp)]
    return EvalMesh(dp_rank=rank // tp, dp_size=dp_size, tp=tp, dp_group=groups[rank % tp])


def _tensor_parallel(model: nn.Module, tp: int) -> None:
    """Shard the model over this rank's group of `tp` neighbours with its family's own
    `parallelize` (its tensor-parallel plan: latent attention, qk-norms, any vocabulary),
    logits replicated. Only tensor parallel: data parallel here means different requests, so
    no DDP/FSDP wrapper (their collectives would tie the groups' forwards together)."""
    from mindspeed_core import device as dev
    from mindspeed_core.parallel import ParallelDims
    from mindspeed_llm.models import get_model_spec

    config = model.config
    if config.num_experts:
        raise ParallelError(
            "tp > 1 evaluation supports dense models; use tp=1 and data parallel for this model"
        )
    dims = ParallelDims(tp=tp, dp_replicate=dist.get_world_size() // tp)
    dims.build(dev.detect_device_type(None))
    get_model_spec(config.family).parallelize(model, dims, data_parallel=False)
