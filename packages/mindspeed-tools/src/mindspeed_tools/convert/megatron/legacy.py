"""Megatron's legacy per-rank checkpoints (`--ckpt-format torch`), read and written.

Reading: every `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` is unpickled onto the meta
device (its structure, and where each tensor's bytes are); each tensor's shards are read
from their offsets, merged over tp (`mapping.tp_merge`), pp and ep and virtual-pipeline
chunks (`model0`, `model1`, ... renumbered to global layers), handed on and dropped: memory
holds about the largest tensor, whatever the model's size. The experts are merged over
expert-parallel ranks (files `mp_rank_TT[_PPP]_EEE`).

Writing: the layout Megatron-LM's `save_checkpoint` writes with `--ckpt-format torch`
(megatron/training/checkpointing.py, `get_checkpoint_name`):
`latest_checkpointed_iteration.txt` holding `1`, and
`iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt`, a `torch.save` of {"args",
"checkpoint_version": 3.0, "iteration": 1, "model"}; each "model" is the rank's shard of
Megatron-Core's local-spec GPTModel state dict (`mapping.to_megatron`, cut by
`mapping.tp_split`), layers numbered within the stage. Iteration 1, as MindSpeed-LLM's
converter writes it ("0" and "release" are not resumed from).
"""

from __future__ import annotations

import hashlib
import re
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_tools.convert.megatron import mapping
from mindspeed_tools.convert.megatron.files import (
    COMMON_FILE,
    LATEST_FILE,
    LEGACY_FILE,
    MegatronTensors,
    args_of,
    safe_torch_load,
)
from mindspeed_tools.convert.megatron.files import arg as _arg

ITERATION = 1
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# -- reading -----------------------------------------------------------------------------------


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


def read_legacy(folder: Path) -> MegatronTensors:
    """The tensors of the legacy iteration folder `folder`, merged over every rank."""
    found = _rank_files(folder)
    first = found[min(found)]
    opened = {first: _RankFile(first)}
    args = args_of(opened[first].state, first)
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
                    glob = mapping.global_name(name, offset, ep * local_experts)
                    if ep > 0 and not mapping.is_expert(glob):
                        continue  # every expert rank holds the same dense tensors
                    split = etp_size > 1 or not mapping.is_expert(glob)
                    held = range(tp_size) if split else range(1)
                    sources[glob] = [(rank_files[tp], _shard(parts[tp], name, rank_files[tp]))
                                     for tp in held]  # fmt: skip
                    meta[glob] = mapping.tp_merge(glob, [t.to("meta") for _, t in sources[glob]])

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for glob, parts in sources.items():
            yield glob, mapping.tp_merge(glob, [file.read(t, glob) for file, t in parts])

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
                "virtual-pipeline chunks (model0, ...) but the args give none"
                if vpp
                else f"no {key!r} (the args give {chunks} virtual-pipeline chunk(s))"
            )
            raise CheckpointError(f"{file.file}: {why}")
        out.append(
            {
                k: v
                for k, v in model.items()
                if isinstance(v, torch.Tensor) and not k.endswith(mapping.SKIPPED)
            }
        )
    return out


def _check_distinct(
    file: _RankFile, chunks: list[dict[str, torch.Tensor]], seen: dict[str, Path]
) -> None:
    """Refuse a rank file whose tensors another rank file holds too: every (tp, pp, ep) rank
    saves different shards, layers or experts, so a repeat is a file copied over another
    (which would convert silently into a wrong model). Each tensor is fingerprinted by its
    name, shape, dtype and the bytes of its first and last 4096 values (read from the file,
    not the whole tensor)."""
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


# -- writing -----------------------------------------------------------------------------------


def to_megatron(hf: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> Megatron's whole tensors (global layer numbers)."""
    groups = config.num_kv_heads or config.num_heads
    heads = mapping.Heads(
        config.num_heads, groups, config.head_dim or config.hidden_size // config.num_heads
    )
    return mapping.to_megatron(hf, heads, config.num_layers, model_type=config.family)


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
        mapping.EMBEDDING: pp_rank == 0,
        "decoder.final_layernorm.weight": pp_rank == pp - 1,
        # tied: the last stage keeps its own copy of the embedding, unless it is the first
        mapping.OUTPUT: pp_rank == pp - 1 and not (config.tie_word_embeddings and pp == 1),
    }
    state = {}
    for name, tensor in whole.items():
        stage, key = mapping.stage_name(name, per_stage)
        here = top_here[name] if stage is None else stage == pp_rank
        if not here:
            continue
        state[key] = mapping.tp_split(name, tensor, tp, tp_rank).clone()
    return state


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
