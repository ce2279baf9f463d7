"""Where the RL roles run: colocated in the training processes, or as Ray actors.

The policy trains in the training processes (one process, a torchrun job, or Ray actors:
`run_on_trainer_actors`). The other roles can run elsewhere:

- `colocated` (default): the rollout samples with the policy module itself (or a whole
  copy refreshed from the shards), the reference is a frozen copy under the run's layout,
  the rewards run in worker processes of each rank (`rewards.Rewards`).
- `ray` (`pip install 'mindspeed-align[ray]'`): each training rank gets its own rollout
  actor (a whole copy of the policy, its weights sent by the rank at every step:
  `rollout/weight_sync_s` and `rollout/weight_sync_bytes`), reference actor (a whole copy
  of the starting model, built with the run's seed and weights, so its log-probs are the
  colocated ones) and reward actor, on a Ray cluster (`RAY_ADDRESS`, or a local one
  started for a single-process run). Ray places them on its own processes and machines;
  the rank sends weights, prompts, packed batches and texts, and gets samples, log-probs
  and scores back. PPO's critic gets a critic actor per training rank: the critic actors
  form a process group of their own on the run's layout, value the rank's micro-batches and
  train on its mini-batches (`ray_groups.place_critic`). With `rollout_engine: vllm` the
  rollout actor starts a vLLM engine as its own child (`_VLLMRolloutWorker`): each step
  fills the actor's copy, which vLLM then reloads; an engine's death is `RoleDied` naming
  the rollout engine. The reference's work is submitted before the policy's own forwards,
  so the two overlap. An actor that dies ends the run with one line naming its role
  (`RoleDied`), not a hang.

Every actor is started by one method, `RayRoles.place`: one CPU, and for a role that holds a
model (rollout, reference, critic, trainer) the run's `ray_resources` (`{GPU: 1}` as Ray's
num_gpus, `{NPU: 1}` or any other key as a custom resource), so a GPU or NPU cluster gives
each role its device; each role's log line says what Ray assigned it.

Both kinds of role implement the protocols declared in `roles.py` (`Rollout`, `Reference`,
`RewardScorer`, `Critic`; `tests/test_roles.py` checks each, method by method), so the
step does not know where they run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from mindspeed_align.rl.objective import recompute_logps
from mindspeed_align.rl.reference import LocalReference
from mindspeed_align.rl.roles import RoleDied
from mindspeed_core.errors import ConfigError, MindSpeedError
from mindspeed_core.lifeline import Reaper
from mindspeed_llm.data.collate import Batch

__all__ = ["LocalReference", "RayRoles", "RoleDied"]


ROLE_ACTORS = 4
"""Actors per training rank at most: rollout, reference, reward and (PPO) critic."""

READY_S = 300.0
"""Seconds an actor may take to start (import torch, build its model) before the run stops."""


def _get(ref, role: str, section: str, timeout: float | None = None):
    """`ray.get(ref)`, an actor's death raised as `RoleDied` naming `role`."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayActorError as err:
        why = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise RoleDied(f"{section}.placement=ray: the {role} actor died ({why})") from None
    except ray.exceptions.RayTaskError as err:  # e.g. the actor's vLLM engine died: its line
        if isinstance(err.cause, RoleDied):
            raise RoleDied(str(err.cause)) from None
        raise

logger = logging.getLogger("mindspeed.rl")


class _Worker:
    """What every role's actor answers besides its role's calls."""

    def resources(self) -> dict[str, float]:
        """What Ray assigned to this actor (CPU, GPU, custom accelerators)."""
        import ray

        return {k: v for k, v in ray.get_runtime_context().get_assigned_resources().items()
                if not k.startswith("node:")}  # fmt: skip


class _ReferenceWorker(_Worker):
    """A Ray actor: the starting model, whole and frozen, on its own process."""

    def __init__(self, config, *, seed: int, seq_len: int, precision: str, hf_path, init_from,
                 init_key: str = "init_from"):  # fmt: skip
        import torch

        from mindspeed_core.parallel import ParallelConfig
        from mindspeed_llm.train.build import build_model
        from mindspeed_llm.train.start import StartingWeights, starting_model

        parallel = ParallelConfig()
        dims = parallel.dims(1).build("cpu")
        build = functools.partial(build_model, config, dims, torch.device("cpu"), parallel=parallel,
                                  seed=seed, seq_len=seq_len, precision=precision, hf_path=hf_path)  # fmt: skip
        start = None if init_from is None else StartingWeights(path=init_from, key=init_key)
        self.model = starting_model(build, start)  # the policy as it started, frozen

    def logps(self, batches: list[Batch], temperature: float) -> list[Tensor]:
        # one whole process: the output layer runs on the response positions alone
        return [recompute_logps(self.model, b, temperature, supervised_only=True) for b in batches]


class _RewardWorker(_Worker):
    """A Ray actor: the rule rewards (in its own worker pool) and the reward model."""

    def __init__(self, rl, tokenizer_path):
        from mindspeed_align.rl.reward_model import section_rewards
        from mindspeed_llm.tokenizer import load_tokenizer

        self.rewards = section_rewards(rl, load_tokenizer(tokenizer_path))

    def score(self, prompts, completions, columns):
        return self.rewards(prompts, completions, columns)

    def close(self) -> None:
        self.rewards.close()


class _RolloutWorker(_Worker):
    """A Ray actor: a whole copy of the policy that samples; the trainer sends its weights."""

    def __init__(self, config, *, seq_len: int, precision: str, lora=None):
        import torch

        from mindspeed_align.rl.rollout import LocalRollout
        from mindspeed_core.parallel import ParallelConfig
        from mindspeed_llm.peft import lora_transform
        from mindspeed_llm.train.build import build_model

        parallel = ParallelConfig()
        dims = parallel.dims(1).build("cpu")
        after_tp = lora_transform(lora) if lora is not None and lora.enabled else None
        self.model = build_model(config, dims, torch.device("cpu"), parallel=parallel,
                                 seq_len=seq_len, precision=precision, frozen=True,
                                 after_tp=after_tp)  # fmt: skip
        self.rollout = LocalRollout(self.model)

    def load(self, state: dict[str, Tensor], adapters_only: bool = False) -> None:
        """The policy's weights; with `adapters_only`, its LoRA adapters alone (the frozen
        base came with the first load)."""
        target = self.model.model.state_dict()
        wanted = [k for k in target if ".lora_" in k] if adapters_only else list(target)
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise ValueError(f"the policy's weights lack {missing[:3]}")
        for key in wanted:
            target[key].copy_(state[key])

    def generate(self, prompts, cfg, seed: int):
        return self.rollout.generate(prompts, cfg, seed=seed)

    def prompts_within_budget(self, prompt_len: int, cfg) -> int:
        return self.rollout.prompts_within_budget(prompt_len, cfg)


class _VLLMRolloutWorker(_RolloutWorker):
    """A Ray actor: the whole copy of the policy that `load` fills, and a vLLM engine (its
    child process: the engine's parent watch ends it with the actor) that samples; each
    `load` writes the copy's weights (merged, for LoRA) and vLLM reloads them."""

    def __init__(self, config, *, seq_len: int, precision: str, lora=None, python: Path,
                 seed: int = 0, section: str = "grpo"):  # fmt: skip
        super().__init__(config, seq_len=seq_len, precision=precision, lora=lora)
        from mindspeed_align.rl.lora import merged_policy
        from mindspeed_align.rl.vllm_rollout import VLLMRollout

        lora_on = lora is not None and lora.enabled
        policy = merged_policy(self.model, lora) if lora_on else self.model
        self.rollout = VLLMRollout(policy, python, max_model_len=seq_len, seed=seed,
                                   section=section)  # fmt: skip

    def load(self, state: dict[str, Tensor], adapters_only: bool = False) -> None:
        super().load(state, adapters_only)
        self.rollout.sync_weights()


class _RayRollout:
    """The rollout of one training rank on its Ray actor (`LocalRollout`'s calls)."""

    copy = True

    def __init__(self, actor, policy, section: str, *, lora: bool = False):
        self.actor, self.policy, self.section = actor, policy, section
        self.lock = threading.Lock()
        self.last_bytes = 0
        self.adapters_only = False
        """The actor holds the frozen base of a LoRA policy: send the adapters alone."""
        self.lora = lora

    def sync_weights(self) -> float:
        """Sends the policy's whole weights (gathered from the shards; a LoRA policy's
        adapters alone after the first time) to the actor; seconds taken (`last_bytes`:
        how many bytes)."""
        from mindspeed_align.rl.rollout import whole_weights

        start = time.perf_counter()
        only = self.adapters_only
        weights = whole_weights(self.policy.model, adapters_only=only)
        state = {k: v.detach().cpu() for k, v in weights}
        self.last_bytes = sum(t.numel() * t.element_size() for t in state.values())
        with self.lock:
            _get(self.actor.load.remote(state, only), "rollout", self.section)
        self.adapters_only = self.lora
        return time.perf_counter() - start

    def generate(self, prompts, cfg, *, seed: int):
        with self.lock:
            return _get(self.actor.generate.remote([list(p) for p in prompts], cfg, seed),
                        "rollout", self.section)  # fmt: skip

    def prompts_within_budget(self, prompt_len: int, cfg) -> int:
        return _get(self.actor.prompts_within_budget.remote(prompt_len, cfg), "rollout", self.section)


class _RayReference:
    def __init__(self, actor, section: str):
        self.actor, self.section = actor, section

    def submit(self, batches: list[Batch], temperature: float) -> Callable[[], list[Tensor]]:
        ref = self.actor.logps.remote(batches, temperature)
        return lambda: _get(ref, "reference", self.section)


class _RayRewards:
    def __init__(self, actor, section: str):
        self.actor, self.section = actor, section

    def __call__(self, prompts, completions, columns):
        return _get(self.actor.score.remote(list(prompts), list(completions), columns), "reward",
                    self.section)  # fmt: skip

    def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):  # dead: the run said so
            ray.get(self.actor.close.remote())


def _constructor_error(err, kind: type[MindSpeedError]) -> MindSpeedError:
    """An actor's constructor's error (`err`: Ray's, whose message ends with the traceback's
    last line, `module.Error: message`) as a one-line `kind`."""
    cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else err
    line = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
    name, sep, message = line.partition(": ")
    return kind(message if sep and re.fullmatch(r"[\w.]+", name) else line)


class RayRoles:
    """The reference and reward actors of this training rank on a Ray cluster.

    Args:
        section: the algorithm's config section name (for messages).
        world_size: training processes; several need a running cluster (`RAY_ADDRESS`).
    """

    def __init__(self, section: str, world_size: int, *, cpus: int = ROLE_ACTORS,
                 show_logs: bool = False, resources: dict[str, float] | None = None):  # fmt: skip
        # The actors run this interpreter's environment as it is: no `uv run` runtime
        # environment packaged from the working directory (Ray's default under uv; read
        # when ray is first imported).
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        try:
            import ray
        except ImportError:
            raise ConfigError(
                f"{section}.placement=ray needs Ray: pip install 'mindspeed-align[ray]'"
            ) from None
        self.ray, self.actors = ray, []
        self.started, self.reaper = False, None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address is None and world_size > 1:
                raise ConfigError(
                    f"{section}.placement=ray with {world_size} training processes needs a "
                    "running Ray cluster: start one (`ray start --head`) and set RAY_ADDRESS"
                )
            # a local cluster: logical CPUs for every actor of this run (`cpus`), even on 2 cores
            cpus = None if address else max(os.cpu_count() or 1, cpus)
            ray.init(address=address, num_cpus=cpus, include_dashboard=False,
                     log_to_driver=show_logs, configure_logging=False)  # fmt: skip
            self.started = address is None
            if self.started:  # a killed trainer takes the local cluster's agents with it
                self.reaper = Reaper()
        self.section = section
        self.resources = dict(resources or {})

    def place(self, role: str, worker: type, *args, name: str | None = None, **kwargs):
        """Start `worker(*args, **kwargs)` as the `role` actor: one CPU, and for a role that
        holds a model the run's `ray_resources` (GPU as Ray's num_gpus, any other key a
        custom resource); wait until it is up. Every role is placed here."""
        options: dict = {"num_cpus": 1}
        if role != "reward":
            extra = dict(self.resources)
            if "GPU" in extra:
                options["num_gpus"] = extra.pop("GPU")
            if extra:
                options["resources"] = extra
        if name is not None:
            options["name"] = name
        actor = self.ray.remote(worker).options(**options).remote(*args, **kwargs)
        self.actors.append(actor)
        return actor

    def _started(self, actor, role: str) -> None:
        """Log where `role` runs and what Ray gave it."""
        got = _get(actor.resources.remote(), role, self.section)
        runs = "rewards run" if role == "reward" else f"{role} runs"
        logger.info("%s: the %s on Ray actor %s (%s)", self.section, runs, actor._actor_id.hex(),
                    ", ".join(f"{k} {v:g}" for k, v in sorted(got.items())))  # fmt: skip

    def reference(self, config, *, seed: int, seq_len: int, precision: str,
                  hf_path: Path | None, init_from: Path | None) -> _RayReference:  # fmt: skip
        actor = self.place("reference", _ReferenceWorker, config, seed=seed, seq_len=seq_len,
                           precision=precision, hf_path=hf_path, init_from=init_from,
                           init_key=f"{self.section}.init_from")  # fmt: skip
        self._ready(actor, "reference")
        self._started(actor, "reference")
        return _RayReference(actor, self.section)

    def rollout(self, policy, *, seq_len: int, precision: str, lora=None,
                vllm_python: Path | None = None, seed: int = 0) -> _RayRollout:  # fmt: skip
        """The rollout of `policy` (this rank's `BuiltModel`; `lora`: its adapters'
        `LoRAConfig`, which the actor's copy gets too) on its own actor; with `vllm_python`
        (vLLM's interpreter) the actor samples on a vLLM engine of its own."""
        if vllm_python is None:
            actor = self.place("rollout", _RolloutWorker, policy.config, seq_len=seq_len,
                               precision=precision, lora=lora)  # fmt: skip
        else:
            actor = self.place("rollout", _VLLMRolloutWorker, policy.config, seq_len=seq_len,
                               precision=precision, lora=lora, python=vllm_python, seed=seed,
                               section=self.section)  # fmt: skip
        try:
            self._ready(actor, "rollout", constructor_errors=vllm_python is not None)
        except self.ray.exceptions.RayActorError as err:  # vLLM did not start: its line
            raise _constructor_error(err, RoleDied) from None
        self._started(actor, "rollout")
        return _RayRollout(actor, policy, self.section, lora=lora is not None and lora.enabled)

    def rewards(self, rl, tokenizer_path: Path) -> _RayRewards:
        actor = self.place("reward", _RewardWorker, rl, tokenizer_path)
        try:
            self._ready(actor, "reward", constructor_errors=True)
        except self.ray.exceptions.RayActorError as err:  # its constructor refused the config
            raise _constructor_error(err, ConfigError) from None
        self._started(actor, "reward")
        return _RayRewards(actor, self.section)

    def _ready(self, actor, role: str, *, constructor_errors: bool = False) -> None:
        """Wait until `actor` is up; one that cannot be placed (no free CPU on the cluster)
        would wait forever, so past `READY_S` it is `RoleDied`. `constructor_errors`: a
        constructor's exception reaches the caller as Ray raised it."""
        ref = actor.__ray_ready__.remote()
        try:
            if constructor_errors:
                self.ray.get(ref, timeout=READY_S)
            else:
                _get(ref, role, self.section, timeout=READY_S)
        except self.ray.exceptions.GetTimeoutError:
            raise RoleDied(
                f"{self.section}.placement=ray: the {role} actor did not start within "
                f"{READY_S:.0f} s (each role takes one CPU of the cluster: see `ray status`)"
            ) from None

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.started:
            self.ray.shutdown()
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None
