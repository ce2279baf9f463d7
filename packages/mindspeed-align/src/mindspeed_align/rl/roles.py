"""The interface of each RL role, declared once.

A GRPO/PPO step talks to four roles besides the policy it trains: the rollout (samples
with the current weights), the reference (log-probs of the starting policy), the rewards
(scores of completions) and, for PPO, the critic (values, and its own update). Each role
runs colocated in the training process (`LocalRollout`, `LocalReference`, `Rewards`,
`ppo.LocalCritic`) or on a Ray actor placed by `placement.RayRoles.place` (the `_Ray*`
proxies); both implement the protocol below, so the step calls the same methods wherever
a role runs. `tests/test_roles.py` checks every implementation against its protocol, method
by method, so a change to one side that the other lacks fails there, not in a Ray run.
The implementations do not subclass the protocols (a protocol's empty method would
stand in for a missing one); the structural check is the test's.

The policy trainer is not a role with methods: it is the command itself, run in the
training processes or on Ray trainer actors (`ray_groups.run_on_trainer_actors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from mindspeed_core.errors import MindSpeedError

__all__ = ["Critic", "Reference", "RewardScorer", "RoleDied", "Rollout"]


@runtime_checkable
class Rollout(Protocol):
    """Samples completions with the policy's current weights."""

    last_bytes: int
    """Bytes the last `sync_weights` moved (the `rollout/weight_sync_bytes` metric)."""

    def sync_weights(self) -> float:
        """Bring the policy's current weights to the sampler; seconds taken."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], cfg: Any, *, seed: int) -> Any:
        """`cfg.n` samples of each prompt (`rollout.SamplingConfig` -> `RolloutBatch`)."""
        ...

    def prompts_within_budget(self, prompt_len: int, cfg: Any) -> int:
        """How many prompts of `prompt_len` tokens one decoding batch holds in the KV budget."""
        ...


@runtime_checkable
class Reference(Protocol):
    """Log-probs of the frozen starting policy."""

    def submit(self, batches: list, temperature: float) -> Callable[[], list[Tensor]]:
        """Start computing the log-probs of the batches' labels; call the result to get them
        (so the reference's work overlaps the policy's own forwards)."""
        ...


@runtime_checkable
class RewardScorer(Protocol):
    """Scores completions (rule functions, a reward model, outside judges)."""

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(total reward per completion, metrics: each reward's mean and the failures)."""
        ...

    def close(self) -> None:
        """Stop any workers."""
        ...


@runtime_checkable
class Critic(Protocol):
    """PPO's value model with its own optimizer."""

    states: dict[str, Any]
    """Its checkpoint `Stateful`s by name (saved under `critic_<name>`)."""

    def values(self, batches: list) -> list[Tensor]:
        """The value of every token of the batches, under the current critic."""
        ...

    def __call__(self, mini: list, *, schedule: bool = True) -> Any:
        """One update on a mini-batch of micro-batches (a `StepResult`)."""
        ...


class RoleDied(MindSpeedError):
    """A role's Ray actor died (killed, out of memory, its node lost): the run cannot go on."""
