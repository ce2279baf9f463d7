"""Megatron's torch_dist saves (dist_checkpointing): a DCP folder of global tensors, homogeneous
layers stacked along a leading axis (experts along a second), read one layer's slice at a time
(`mapping.unstacked`), plus `common.pt` holding the args."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.checkpoint import read_safe_metadata
from mindspeed_core.errors import CheckpointError
from mindspeed_llm.hf_export.dcp_stream import Region, RegionReader
from mindspeed_tools.convert.megatron import mapping
from mindspeed_tools.convert.megatron.files import (
    COMMON_FILE,
    MegatronTensors,
    args_of,
    safe_torch_load,
)
from mindspeed_tools.convert.megatron.files import arg as _arg


def read_torch_dist(folder: Path) -> MegatronTensors:
    """The model tensors of the torch_dist iteration folder `folder`."""
    args = args_of(safe_torch_load(folder / COMMON_FILE), folder / COMMON_FILE)
    metadata = read_safe_metadata(folder)
    names = {}
    for name, meta in metadata.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        wanted = name in mapping.TOP_NAMES or name.startswith("decoder.layers.")
        if size is not None and wanted and not name.endswith(mapping.SKIPPED):
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
        for glob, offsets, sizes, whole in mapping.unstacked(name, shape, num_layers, folder):
            regions.append((glob, Region(key, offsets, sizes, dtype), whole))
    regions.sort(key=lambda item: mapping.reading_order(item[0]))
    reader = RegionReader(folder, {glob: region for glob, region, _ in regions})
    meta = {glob: torch.empty(whole, dtype=r.dtype, device="meta") for glob, r, whole in regions}
    budget = max(r.nbytes for r in reader.regions.values())  # one region, or a few small

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for glob, tensor in reader.items(budget=budget):
            yield glob, tensor.view(meta[glob].shape)

    return MegatronTensors(args=args, folder=folder, meta=meta, read=read)
