"""The whole tensors of a Megatron save folder, in either format (`legacy`, `torch_dist`)."""

from __future__ import annotations

from pathlib import Path

from mindspeed_tools.convert.megatron.files import COMMON_FILE, MegatronTensors, iteration_dir
from mindspeed_tools.convert.megatron.legacy import read_legacy
from mindspeed_tools.convert.megatron.torch_dist import read_torch_dist


def read_checkpoint(root: str | Path) -> MegatronTensors:
    """The tensors of the Megatron save folder `root` (its latest iteration), in either
    format; the files' structure is read and checked now, the tensors when asked for.

    Raises:
        CheckpointError: a refused pickle, a missing or truncated rank file (named).
    """
    folder = iteration_dir(Path(root))
    if (folder / COMMON_FILE).is_file():
        return read_torch_dist(folder)
    return read_legacy(folder)
