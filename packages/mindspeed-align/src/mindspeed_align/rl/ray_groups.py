"""Ray actors that form a torch.distributed group of their own: PPO's critic actors (one
per training rank, the run's layout, `place_critic`) and the policy's trainer actors
(`grpo.trainer_actors`: the whole command runs on them, `run_on_trainer_actors`). The
other roles, one actor each, are in `placement.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import Tensor
from torch.distributed.tensor import DTensor

from mindspeed_align.rl.placement import (
    READY_S,
    ROLE_ACTORS,
    RayRoles,
    RoleDied,
    _get,
    _Worker,
    logger,
)
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.parallel import dtensor
from mindspeed_llm.data.collate import Batch

__all__ = ["place_critic", "run_on_trainer_actors"]


def _endpoint() -> tuple[str, int]:
    """This actor's node address and a free port on it (a process group's rendezvous)."""
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _join_group(rank: int, world: int, master: tuple[str, int]):
    """This actor as rank `rank` of a `world`-process group whose rank 0 is at `master`."""
    from mindspeed_core.distributed import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))  # fmt: skip
    return init_distributed(device_type="cpu")


def _whole(tree):
    """A state dict with every DTensor gathered into a whole tensor (to leave its process)."""
    if isinstance(tree, DTensor):
        return dtensor.full(tree)
    if isinstance(tree, dict):
        return {k: _whole(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_whole(v) for v in tree)
    return tree


def _shaped_like(template, tree):
    """Whole tensors of `tree` laid out as the DTensors of `template` (a state dict of the
    same names) are: each rank keeps its shard."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(template, DTensor):
        return distribute_tensor(tree.to(template.dtype), template.device_mesh, template.placements)
    if isinstance(template, dict) and isinstance(tree, dict):
        return {k: _shaped_like(template[k], v) if k in template else v for k, v in tree.items()}
    return tree


class _CriticWorker(_Worker):
    """A Ray actor: one rank of PPO's critic (model, optimizer, schedule), in a process group
    of the critic actors alone. Its training rank sends the micro-batches to value and the
    mini-batches to train on; checkpoints move its states as whole tensors."""

    def endpoint(self) -> tuple[str, int]:
        return _endpoint()

    def setup(self, cfg, build, rank: int, world: int, master: tuple[str, int]) -> list[str]:
        """Joins the critic group and builds this rank's critic; the names of its states."""
        from mindspeed_core.distributed import setup_logging

        info = _join_group(rank, world, master)
        setup_logging()
        self.critic = build(cfg, info)
        return list(self.critic.states)

    def values(self, batches: list[Batch]) -> list[Tensor]:
        return self.critic.values(batches)

    def update(self, mini: list[Batch], schedule: bool):
        return self.critic(mini, schedule=schedule)

    def state_dict(self, name: str) -> dict:
        return _whole(self.critic.states[name].state_dict())

    def load_state_dict(self, name: str, state: dict) -> None:
        target = self.critic.states[name]
        target.load_state_dict(_shaped_like(target.state_dict(), state))


class _CriticState:
    """A checkpoint `Stateful` standing for one of a critic actor's states."""

    def __init__(self, actor, name: str, section: str):
        self.actor, self.name, self.section = actor, name, section

    def state_dict(self) -> dict:
        return _get(self.actor.state_dict.remote(self.name), "critic", self.section)

    def load_state_dict(self, state: dict) -> None:
        _get(self.actor.load_state_dict.remote(self.name, state), "critic", self.section)


class _RayCritic:
    """The critic of one training rank on its Ray actor (`ppo.LocalCritic`'s calls)."""

    def __init__(self, actor, names: list[str], section: str):
        self.actor, self.section = actor, section
        self.states = {name: _CriticState(actor, name, section) for name in names}

    def values(self, batches: list[Batch]) -> list[Tensor]:
        return _get(self.actor.values.remote(batches), "critic", self.section)

    def __call__(self, mini: list[Batch], *, schedule: bool = True):
        return _get(self.actor.update.remote(mini, schedule), "critic", self.section)


def place_critic(roles: RayRoles, cfg, build) -> _RayCritic:
    """PPO's critic on Ray actors placed by `roles`: one per training rank, the actors a
    process group of their own (rank r's actor is its rank r) with the run's layout;
    `build(cfg, info)` builds a rank's critic there (`ppo.critic_on_actor`). Every training
    rank calls this."""
    import torch.distributed as dist

    actor = roles.place("critic", _CriticWorker)
    roles._ready(actor, "critic")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    master = [_get(actor.endpoint.remote(), "critic", roles.section) if rank == 0 else None]
    if world > 1:  # rank 0's actor hosts the critic group's rendezvous
        dist.broadcast_object_list(master, src=0)
    names = _get(actor.setup.remote(cfg, build, rank, world, master[0]), "critic", roles.section)
    roles._started(actor, "critic")
    return _RayCritic(actor, names, roles.section)


class _TrainerWorker(_Worker):
    """A Ray actor: one rank of the policy's trainer. It joins its own torch.distributed
    group with the other trainer actors (gloo/NCCL/HCCL as the run's device says) and runs
    the command there, creating its rank's rollout, reference and reward actors itself."""

    def endpoint(self) -> tuple[str, int]:
        """This actor's node address and a free port on it (rank 0 hosts the rendezvous)."""
        return _endpoint()

    def run(self, cfg, entry, rank: int, world: int, master: tuple[str, int]) -> dict:
        from mindspeed_core.distributed import setup_logging

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))  # fmt: skip
        setup_logging()
        cfg.rl.trainer_actors = 0  # this process is the trainer
        return entry(cfg)


def run_on_trainer_actors(cfg, entry: Callable[[object], dict]) -> dict:
    """`grpo.trainer_actors` Ray actors train the policy as one process group, each running
    `entry(cfg)` (the command's function, e.g. `cli.grpo`, with its own rollout, reference
    and reward actors); rank 0's summary. A rank that fails ends the run with its error (a
    `MindSpeedError` as itself, one line), the others killed."""
    section, count = cfg.rl.section, cfg.rl.trainer_actors
    # the trainers' logs shown here; a trainer and its role actors take one logical CPU each
    roles = RayRoles(section, 1, cpus=(1 + ROLE_ACTORS) * count, show_logs=True,
                     resources=cfg.rl.ray_resources)  # fmt: skip
    ray = roles.ray
    try:
        # named, so `ray list actors` (and a test) tells which is which
        actors = [roles.place("trainer", _TrainerWorker, name=f"mindspeed-{section}-trainer-{rank}-{os.getpid()}")
                  for rank in range(count)]  # fmt: skip
        master = _get(actors[0].endpoint.remote(), "trainer", section, timeout=READY_S)
        refs = [actor.run.remote(cfg, entry, rank, count, master) for rank, actor in enumerate(actors)]
        logger.info("%s: the policy trains on %d Ray actors (%s)", section, count,
                    ", ".join(a._actor_id.hex()[:12] for a in actors))  # fmt: skip
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = refs.index(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, MindSpeedError):
                    raise type(cause)(str(cause)) from None
                line = str(cause or err).strip().splitlines()[-1][:200]
                raise RoleDied(f"{section}.placement=ray: trainer rank {rank} failed: {line}") from None
            except ray.exceptions.RayActorError:
                raise RoleDied(f"{section}.placement=ray: the trainer rank {rank} actor died") from None
        return ray.get(refs[0])
    finally:
        roles.close()
