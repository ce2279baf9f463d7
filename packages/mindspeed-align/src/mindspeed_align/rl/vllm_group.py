"""vLLM rollouts under tensor and context parallel: one engine per tp x cp group.

The ranks of a tp x cp group hold shards of the same weights and draw the same samples: the
prompts are shared out by data-parallel rank alone (`data.PromptSource`) and so is the
sampling seed (`rollout.sampling_seed`), which is how the native rollout's tensor-parallel
peers agree without a word. One vLLM engine per group is therefore enough: the group's first
rank runs it (`VLLMRollout`) and broadcasts each batch to the others
(`broadcast_object_list` on the group's process group). Every rank of the group still enters
the gathering of the whole weights, at the start and at every sync: each DTensor's
`full_tensor` is a collective over the mesh it is sharded on (`rollout.whole_weights`); only
the first rank writes them for vLLM. Data-parallel ranks each have their own engine.

A failure of the engine (it did not start, died, answered an error) is broadcast in place of
the batch or the sync's outcome, so every rank of the group raises the same one-line
`RoleDied` naming the rollout engine, and none waits in a collective the first rank will
never enter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mindspeed_align.rl.rollout import RolloutBatch, SamplingConfig, whole_weights
from mindspeed_core.errors import MindSpeedError

__all__ = ["EngineGroup", "SharedVLLMRollout", "engine_group", "start_vllm_rollout"]


@dataclass(frozen=True)
class EngineGroup:
    """The ranks that share one engine: this rank's tp x cp group."""

    group: Any
    """Its process group (None: this rank is alone in it)."""
    first: bool
    """This rank runs the engine."""


def engine_group(dims) -> EngineGroup:
    """This rank's tp x cp group (collective when both are > 1: a process group is made)."""
    axes = [a for a in ("cp", "tp") if dims.degree(a) > 1]
    if not axes:
        return EngineGroup(None, True)
    if len(axes) == 1:
        mesh = dims.mesh(axes[0])
    else:  # cp and tp are neighbours in the world mesh: one flattened axis
        mesh = dims.world_mesh["cp", "tp"]._flatten("rollout_cp_tp")
    return EngineGroup(mesh.get_group(), mesh.get_local_rank() == 0)


class SharedVLLMRollout:
    """The rollout of a tp x cp group on its first rank's vLLM engine (implements
    `roles.Rollout`).

    Args:
        policy: this rank's `BuiltModel` (its shards enter the gathering).
        start: makes the engine (`VLLMRollout`); called on the group's first rank alone.
        group: this rank's `EngineGroup`.
    """

    copy = True

    def __init__(self, policy, start: Callable[[], Any], group: EngineGroup):
        self.policy, self.group = policy, group
        self.engine = None
        self.last_bytes = 0
        """Bytes the engine's last sync wrote (the first rank's, on every rank)."""
        outcome: Any = None
        if group.first:
            try:
                self.engine = start()  # gathers the whole weights: the others do below
            except MindSpeedError as err:
                outcome = err
        else:
            self._gather()
        self._share(outcome)

    def _gather(self) -> None:
        """This rank's part in the first rank's gathering of the whole weights."""
        for _ in whole_weights(self.policy.model):
            pass

    def _share(self, outcome: Any) -> Any:
        """The first rank's `outcome` on every rank of the group; an exception is raised."""
        box = [outcome]
        dist.broadcast_object_list(box, group=self.group.group, group_src=0)
        if isinstance(box[0], BaseException):
            if self.engine is not None:
                self.engine.close()
            raise box[0] from None
        return box[0]

    def sync_weights(self) -> float:
        """Every rank gathers the policy's weights; the first sends them to vLLM."""
        start = time.perf_counter()
        outcome: Any = None
        if self.engine is not None:
            try:
                self.engine.sync_weights()
                outcome = self.engine.last_bytes
            except MindSpeedError as err:
                outcome = err
        else:
            self._gather()
        self.last_bytes = self._share(outcome)
        return time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *, seed: int
                 ) -> RolloutBatch:  # fmt: skip
        """The first rank's engine samples the group's prompts; every rank gets its batch."""
        outcome: Any = None
        if self.engine is not None:
            try:
                outcome = self.engine.generate(prompts, cfg, seed=seed)
            except MindSpeedError as err:
                outcome = err
        batch = self._share(outcome)
        # the group's ranks were handed the same prompts (see the module)
        assert batch.prompt_ids[:: cfg.n] == [list(p) for p in prompts]
        return batch

    def prompts_within_budget(self, prompt_len: int, cfg: SamplingConfig) -> int:
        """vLLM pages its KV cache itself: every prompt fits one call."""
        return 1 << 30

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def start_vllm_rollout(run, cfg):
    """The rollout of this rank on vLLM (`rollout_engine: vllm`, colocated): its own engine,
    or under tp/cp its group's first rank's (`SharedVLLMRollout`)."""
    from mindspeed_align.rl.lora import merged_policy
    from mindspeed_align.rl.vllm_rollout import VLLMRollout, check_policy, ensure_vllm_python

    g = cfg.rl
    python = ensure_vllm_python(run.device.type, g.vllm_python, section=g.section)
    # vLLM gets the LoRA policy's weights merged (W + scaling B A) every step
    policy = merged_policy(run.policy, cfg.lora) if cfg.lora.enabled else run.policy
    check_policy(policy, g.section)  # on every rank, before any gathering

    def start():
        return VLLMRollout(policy, python, max_model_len=cfg.data.seq_len, seed=cfg.train.seed,
                           section=g.section)  # fmt: skip

    group = engine_group(run.dims)
    if group.group is None:
        return start()
    return SharedVLLMRollout(policy, start, group)
