"""Where the RL roles run: colocated in the training processes, or as Ray actors.

The policy (and PPO's critic) always train in the training processes (one process or a
torchrun job), where the rollout runs too, so weight sync stays a local copy. The roles
that only score, the frozen reference and the rewards (rule functions and a reward model),
can run elsewhere:

- `colocated` (default): the reference is a frozen copy under the run's layout, the
  rewards run in worker processes of each rank (`rewards.Rewards`).
- `ray` (`pip install 'mindspeed-align[ray]'`): each training rank gets its own reference
  actor (a whole copy of the starting model, built with the run's seed and weights, so
  its log-probs are the colocated ones) and reward actor, on a Ray cluster
  (`RAY_ADDRESS`, or a local one started for a single-process run). Ray places them on
  its own processes and machines; the rank sends packed batches and texts, and gets
  log-probs and scores back. The reference's work is submitted before the policy's own
  forwards, so the two overlap.

Both kinds of role answer the same calls (`submit(batches, T)()` and
`rewards(prompts, completions, columns)`), so the step does not know where they run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from mindspeed_align.rl.objective import recompute_logps
from mindspeed_core.errors import ConfigError
from mindspeed_core.lifeline import Reaper
from mindspeed_llm.data.collate import Batch

__all__ = ["LocalReference", "RayRoles"]

logger = logging.getLogger("mindspeed.rl")


class LocalReference:
    """The colocated reference: a frozen `BuiltModel` under the run's layout."""

    def __init__(self, model, *, supervised_only: bool = False):
        self.model, self.supervised_only = model, supervised_only

    def submit(self, batches: list[Batch], temperature: float) -> Callable[[], list[Tensor]]:
        """Log-probs of the batches' labels (the response positions alone projected where
        the layout allows), computed when the result is asked for."""
        return lambda: [recompute_logps(self.model, b, temperature, supervised_only=self.supervised_only)
                        for b in batches]  # fmt: skip


class _ReferenceWorker:
    """A Ray actor: the starting model, whole and frozen, on its own process."""

    def __init__(self, config, *, seed: int, seq_len: int, precision: str, hf_path, init_from):
        import torch

        from mindspeed_align.rl.weights import load_weights
        from mindspeed_core.parallel import ParallelConfig
        from mindspeed_llm.train.build import build_model

        parallel = ParallelConfig()
        dims = parallel.dims(1).build("cpu")
        self.model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seed=seed,
                                 seq_len=seq_len, precision=precision, hf_path=hf_path,
                                 frozen=True)  # fmt: skip
        if init_from is not None:
            load_weights(self.model, init_from)

    def logps(self, batches: list[Batch], temperature: float) -> list[Tensor]:
        # one whole process: the output layer runs on the response positions alone
        return [recompute_logps(self.model, b, temperature, supervised_only=True) for b in batches]


class _RewardWorker:
    """A Ray actor: the rule rewards (in its own worker pool) and the reward model."""

    def __init__(self, rl, tokenizer_path):
        from mindspeed_align.rl.reward_model import section_rewards
        from mindspeed_llm.tokenizer import load_tokenizer

        self.rewards = section_rewards(rl, load_tokenizer(tokenizer_path))

    def score(self, prompts, completions, columns):
        return self.rewards(prompts, completions, columns)

    def close(self) -> None:
        self.rewards.close()


class _RayReference:
    def __init__(self, actor):
        self.actor = actor

    def submit(self, batches: list[Batch], temperature: float) -> Callable[[], list[Tensor]]:
        import ray

        ref = self.actor.logps.remote(batches, temperature)
        return lambda: ray.get(ref)


class _RayRewards:
    def __init__(self, actor):
        self.actor = actor

    def __call__(self, prompts, completions, columns):
        import ray

        return ray.get(self.actor.score.remote(list(prompts), list(completions), columns))

    def close(self) -> None:
        import ray

        ray.get(self.actor.close.remote())


class RayRoles:
    """The reference and reward actors of this training rank on a Ray cluster.

    Args:
        section: the algorithm's config section name (for messages).
        world_size: training processes; several need a running cluster (`RAY_ADDRESS`).
    """

    def __init__(self, section: str, world_size: int):
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
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)  # fmt: skip
            self.started = address is None
            if self.started:  # a killed trainer takes the local cluster's agents with it
                self.reaper = Reaper()
        self.section = section

    def reference(self, config, *, seed: int, seq_len: int, precision: str,
                  hf_path: Path | None, init_from: Path | None) -> _RayReference:  # fmt: skip
        actor = self.ray.remote(num_cpus=1)(_ReferenceWorker).remote(
            config, seed=seed, seq_len=seq_len, precision=precision, hf_path=hf_path,
            init_from=init_from,
        )  # fmt: skip
        self.actors.append(actor)
        logger.info("%s: the reference runs on Ray actor %s", self.section, actor._actor_id.hex())
        return _RayReference(actor)

    def rewards(self, rl, tokenizer_path: Path) -> _RayRewards:
        actor = self.ray.remote(num_cpus=1)(_RewardWorker).remote(rl, tokenizer_path)
        self.actors.append(actor)
        try:
            self.ray.get(actor.__ray_ready__.remote())
        except self.ray.exceptions.RayActorError as err:  # its constructor refused the config
            cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else err
            raise ConfigError(str(cause).strip().splitlines()[-1]) from None
        logger.info("%s: the rewards run on Ray actor %s", self.section, actor._actor_id.hex())
        return _RayRewards(actor)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.started:
            self.ray.shutdown()
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None
