"""Megatron-LM / Megatron-Core save folders: where the iteration is, the pickles read without
running code, and the whole tensors a reader yields (`MegatronTensors`).

A Megatron checkpoint folder holds `latest_checkpointed_iteration.txt` (an iteration
number, or `release`) and `iter_NNNNNNN/` (or `release/`) in one of two formats:

- legacy (`--ckpt-format torch`): `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per
  tensor/pipeline(/expert) rank, a `torch.save` of {"args": Namespace, "model": state dict,
  ...}, each tensor the rank's shard, layers numbered within the stage (`legacy`);
- `torch_dist` (Megatron's dist_checkpointing): a DCP folder of global tensors (layers
  stacked along a leading axis) plus `common.pt` (the args) and `metadata.json`
  (`torch_dist`).

Both pickles are read with `torch.load(weights_only=True)` allowing `argparse.Namespace`
(the args); the data-only classes a training checkpoint also holds (Megatron's enums in
the args, numpy's RNG state) unpickle into inert stand-ins, never into themselves. DCP's
`.metadata` goes through our `MetadataUnpickler`. Nothing a file names is ever called: a
pickle naming anything else (os.system, builtins.eval, ...) is refused before it loads.
"""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_core.errors import CheckpointError
from mindspeed_tools.convert.megatron.mapping import to_hf_tensors

LATEST_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
_NAMESPACE = "argparse.Namespace"
_STDLIB_DATA = {"types.SimpleNamespace", "pathlib.PosixPath", "io.BytesIO", "signal.Signals"}


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


def args_of(state: Any, file: Path) -> dict[str, Any]:
    """The saved args of a loaded Megatron pickle, as a dict.

    Raises:
        CheckpointError: it holds none.
    """
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{file} holds no saved args (a Megatron checkpoint saves 'args')")
    return vars(args)


def arg(args: Mapping[str, Any], name: str, file: Path, default: Any = ...) -> Any:
    """Saved arg `name` (or `default`; without one a missing arg is an error naming `file`)."""
    if name in args and args[name] is not None:
        return args[name]
    if default is ...:
        raise CheckpointError(f"{file}: the saved args have no {name}")
    return default


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
