"""`ParallelDims`: the parallel layout, validated up front, and its named DeviceMeshes.

Ranks are laid out row-major over ``(pp, dp_replicate, dp_shard, cp, tp)``: tensor
parallel ranks are neighbours (one node, fastest links), pipeline stages are the
farthest apart. Only axes of degree > 1 enter a mesh, so a degree-1 axis costs no
process group. Besides the five axes, trainers ask for a few flattened ones:

=============== ============================== =====================================
name            made of                        used for
=============== ============================== =====================================
``dp``          dp_replicate x dp_shard        data loading (which batch shard)
``dp_shard_cp`` dp_shard x cp                  FSDP sharding (cp ranks hold the same
                                               weights, so they share the shards)
``loss``        dp_replicate x dp_shard x cp   averaging the loss and token counts
``fsdp``        (dp_replicate, dp_shard_cp)    `apply_fsdp`: 2-D gives HSDP
``ep``          a factor of dp_shard x cp      expert parallel (as torchtitan and
                                               Megatron-Core carve it)
=============== ============================== =====================================

`mesh(name)` returns None for an axis whose degree is 1: there is nothing to
parallelise over, and the apply_* functions take None to mean "not this one".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mindspeed_core import device as dev
from mindspeed_core.errors import ParallelError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}
MESH_NAMES = (*AXES, *_FLATTENED, "fsdp", "ep", "dp_shard_mod_ep")


@dataclass
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the world size.

    Args:
        dp_replicate: data-parallel replicas (DDP, or the outer axis of HSDP).
        dp_shard: data-parallel shards (FSDP); -1 takes whatever the other degrees leave.
        cp: context parallel (the sequence split across ranks).
        tp: tensor parallel.
        pp: pipeline parallel stages.
        ep: expert parallel; a factor of dp_shard x cp (experts are spread over
            ranks that would otherwise shard the same weights).
        world_size: number of processes; None reads it from the default process
            group (1 when there is none).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int | None = None
    _meshes: dict[str, DeviceMesh | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size is None:
            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._validate()

    def _validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            _check_degree(name, getattr(self, name))
        if self.dp_shard != -1:
            _check_degree("dp_shard", self.dp_shard)
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelError(
                    f"cannot infer dp_shard: dp_replicate({self.dp_replicate}) x cp({self.cp}) "
                    f"x tp({self.tp}) x pp({self.pp}) = {others} does not divide the world "
                    f"size {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelError(
                f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) "
                f"x tp({self.tp}) x pp({self.pp}) = {product}, but the world size is "
                f"{self.world_size}; make the product equal the number of processes"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ParallelError(
                f"ep={self.ep} must divide dp_shard x cp = {self.dp_shard * self.cp}: experts are "
                "spread over the ranks that shard the same weights"
            )

    # -- degrees -------------------------------------------------------------------

    def degree(self, name: str) -> int:
        """The size of the axis `name` (one of `MESH_NAMES`, "fsdp" excepted)."""
        if name in AXES or name == "ep":
            return getattr(self, name)
        if name in _FLATTENED:
            return math.prod(getattr(self, a) for a in _FLATTENED[name])
        if name == "dp_shard_mod_ep":
            return self.dp_shard * self.cp // self.ep
        raise ParallelError(f"unknown mesh axis {name!r}; known: {', '.join(MESH_NAMES)}")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    # -- meshes --------------------------------------------------------------------

    def build(self, device_type: str | None = None) -> ParallelDims:
        """Create every process group this layout needs (collective: call on all ranks).

        Returns self, so `dims = ParallelDims(tp=2).build()` reads well.
        """
        if self._meshes:
            return self
        if self.world_size > 1 and not dist.is_initialized():
            raise ParallelError(
                f"a layout over {self.world_size} processes needs a process group; "
                "call mindspeed_core.distributed.init_distributed() first"
            )
        if self.world_size > 1 and dist.get_world_size() != self.world_size:
            raise ParallelError(
                f"ParallelDims was made for {self.world_size} processes but "
                f"{dist.get_world_size()} are running"
            )
        device_type = dev.detect_device_type(device_type)
        self._meshes = _build_meshes(self, device_type)
        return self

    def mesh(self, name: str) -> DeviceMesh | None:
        """The DeviceMesh of axis `name`, or None when its degree is 1."""
        if name not in MESH_NAMES:
            raise ParallelError(f"unknown mesh axis {name!r}; known: {', '.join(MESH_NAMES)}")
        if not self._meshes:
            self.build()
        return self._meshes.get(name)

    def rank(self, name: str) -> int:
        """This process's index along axis `name` (0 when the axis is disabled)."""
        mesh = self.mesh(name)
        if mesh is None:
            return 0
        if mesh.ndim != 1:
            raise ParallelError(f"mesh {name!r} is {mesh.ndim}-D; ask for a 1-D axis")
        return mesh.get_local_rank()

    @property
    def world_mesh(self) -> DeviceMesh | None:
        """The full mesh over the enabled axes (None in a one-process layout)."""
        if not self._meshes:
            self.build()
        return self._meshes.get("_world")


def _check_degree(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelError(f"parallel degree {name}={value!r} must be a positive integer")


def _build_meshes(dims: ParallelDims, device_type: str) -> dict[str, DeviceMesh | None]:
    enabled = [a for a in AXES if getattr(dims, a) > 1]
    meshes: dict[str, DeviceMesh | None] = dict.fromkeys(MESH_NAMES)
    if not enabled:
        return meshes
    world = init_device_mesh(
        device_type, tuple(getattr(dims, a) for a in enabled), mesh_dim_names=tuple(enabled)
    )
    meshes["_world"] = world
    for axis in enabled:
        meshes[axis] = world[axis]
    for name, parts in _FLATTENED.items():
        meshes[name] = _flatten(world, name, [p for p in parts if p in enabled])
    meshes["fsdp"] = _fsdp_mesh(dims, world, meshes)
    if dims.ep > 1:
        _add_expert_axes(dims, world, meshes)
    return meshes


def _flatten(world: DeviceMesh, name: str, parts: list[str]) -> DeviceMesh | None:
    """One 1-D mesh over `parts`; an alias (no new group) when only one part is enabled."""
    if not parts:
        return None
    if len(parts) == 1:
        return world[parts[0]]
    return world[tuple(parts)]._flatten(name)


def _fsdp_mesh(dims: ParallelDims, world: DeviceMesh, meshes: dict) -> DeviceMesh | None:
    replicate, shard = meshes["dp_replicate"], meshes["dp_shard_cp"]
    if replicate is None or shard is None:
        return shard
    if dims.cp == 1:  # (dp_replicate, dp_shard) is already a 2-D slice of the world mesh
        return world["dp_replicate", "dp_shard"]
    # HSDP with context parallel: a 2-D view whose inner axis spans dp_shard x cp.
    return meshes["loss"]._unflatten(
        0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp")
    )


def _add_expert_axes(dims: ParallelDims, world: DeviceMesh, meshes: dict) -> None:
    """ep is the inner factor of dp_shard x cp; dp_shard_mod_ep the outer one."""
    outer = dims.dp_shard * dims.cp // dims.ep
    source = meshes["dp_shard_cp"]
    view = source._unflatten(0, (outer, dims.ep), ("dp_shard_mod_ep", "ep"))
    meshes["ep"] = view["ep"]
    meshes["dp_shard_mod_ep"] = view["dp_shard_mod_ep"] if outer > 1 else None
