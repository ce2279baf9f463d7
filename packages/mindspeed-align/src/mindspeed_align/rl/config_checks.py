"""The checks of an RL algorithm's section (`grpo`, `ppo`, `dapo`): each refuses a value in one
line naming the field (`ConfigError`); `GRPOSection.__post_init__` runs them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mindspeed_align.rl.advantages import ESTIMATORS
from mindspeed_align.rl.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from mindspeed_align.rl.rewards import reward_entries, reward_weights
from mindspeed_core.errors import ConfigError

if TYPE_CHECKING:
    from mindspeed_align.rl.config import GRPOSection


def check_grpo_section(self: GRPOSection) -> None:
    """Every check of a `grpo`/`ppo` section, each naming the field and value it refuses."""
    name = self.section
    estimator = ESTIMATORS.get(self.advantage)
    if estimator is None:
        raise ConfigError(f"{name}.advantage={self.advantage!r} is not one of {tuple(ESTIMATORS)}")
    if estimator.critic and name == "grpo":
        raise ConfigError(f"grpo.advantage={self.advantage!r} needs a critic: use `mindspeed ppo`")
    if self.n < 2 and estimator.group:
        raise ConfigError(f"{name}.n={self.n}: group advantages "
                          f"({name}.advantage={self.advantage}) need at least 2 samples "
                          "per prompt")  # fmt: skip
    if self.n < 1:
        raise ConfigError(f"{name}.n={self.n} must be positive")
    for field_name in ("epochs", "mini_batches"):
        if getattr(self, field_name) < 1:
            raise ConfigError(f"{name}.{field_name}={getattr(self, field_name)} must be >= 1")
    if self.loss not in POLICY_LOSSES:
        raise ConfigError(f"{name}.loss={self.loss!r} is not one of {tuple(POLICY_LOSSES)}")
    if self.loss_agg is not None and self.loss_agg not in AGGREGATIONS:
        raise ConfigError(f"{name}.loss_agg={self.loss_agg!r} is not one of {AGGREGATIONS}")
    if self.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"{name}.kl_estimator={self.kl_estimator!r} is not one of k1/k2/k3")
    if not self.temperature > 0:
        raise ConfigError(f"{name}.temperature={self.temperature} must be > 0")
    if self.max_new_tokens < 1:
        raise ConfigError(f"{name}.max_new_tokens={self.max_new_tokens} must be positive")
    if self.placement not in ("colocated", "ray"):
        raise ConfigError(f"{name}.placement={self.placement!r} is not colocated or ray")
    if self.rollout_kv_mb < 0:
        raise ConfigError(f"{name}.rollout_kv_mb={self.rollout_kv_mb} must be >= 0")
    low, high = self.clip_range()
    if not (0 <= low <= 1 and high >= 0):
        raise ConfigError(f"{name}.clip_low={low} / clip_high={high}: clip_low must be in "
                          "[0, 1], clip_high >= 0")  # fmt: skip
    if not 0 <= self.overlong_buffer < self.max_new_tokens:
        raise ConfigError(f"{name}.overlong_buffer={self.overlong_buffer} must be in "
                          f"[0, {name}.max_new_tokens={self.max_new_tokens})")  # fmt: skip
    if self.dual_clip is not None and self.dual_clip <= 1:
        raise ConfigError(f"{name}.dual_clip={self.dual_clip} must be > 1")
    if self.dual_clip is not None and not POLICY_LOSSES[self.loss].dual_clip:
        raise ConfigError(f"{name}.dual_clip={self.dual_clip}: {name}.loss={self.loss} "
                          "takes no dual clip")  # fmt: skip
    cap = self.rollout_correction_cap
    if cap is not None and not cap >= 1:
        raise ConfigError(f"{name}.rollout_correction_cap={cap} must be >= 1 (or null: off)")
    if self.shared_prompts not in ("auto", "on", "off"):
        raise ConfigError(f"{name}.shared_prompts={self.shared_prompts!r} is not auto, on or off")
    check_async(self)
    for key, amount in self.ray_resources.items():
        if not amount > 0:
            raise ConfigError(f"{name}.ray_resources.{key}={amount} must be > 0")
    if self.ray_resources and self.placement != "ray":
        raise ConfigError(f"{name}.ray_resources needs {name}.placement=ray")
    if self.trainer_actors < 0 or (self.trainer_actors and self.placement != "ray"):
        raise ConfigError(f"{name}.trainer_actors={self.trainer_actors}: a count >= 0, "
                          f"above 0 only with {name}.placement=ray")  # fmt: skip
    if self.rollout_engine not in ("native", "vllm"):
        raise ConfigError(f"{name}.rollout_engine={self.rollout_engine!r} is not native or vllm")
    if self.vllm_python is not None and self.rollout_engine != "vllm":
        raise ConfigError(f"{name}.vllm_python needs {name}.rollout_engine=vllm")
    if self.vllm_python is not None and not Path(self.vllm_python).is_file():
        raise ConfigError(f"{name}.vllm_python={self.vllm_python}: no such interpreter")
    if self.env_max_turns < 1 or self.env_max_tokens < 1:
        raise ConfigError(f"{name}.env_max_turns={self.env_max_turns} and "
                          f"{name}.env_max_tokens={self.env_max_tokens} must be positive")  # fmt: skip
    reward_weights(reward_entries(self.rewards, name), self.reward_weights, name)

def check_async(self: GRPOSection) -> None:
    name, mode = self.section, self.async_rollout
    if mode not in ("off", "one_step", "bounded"):
        raise ConfigError(f"{name}.async_rollout={mode!r} is not off, one_step or bounded")
    if self.max_staleness < 1:
        raise ConfigError(f"{name}.max_staleness={self.max_staleness} must be >= 1")
    if self.max_staleness != 1 and mode != "bounded":
        raise ConfigError(f"{name}.max_staleness={self.max_staleness} needs "
                          f"{name}.async_rollout=bounded (one_step's is 1)")  # fmt: skip
    unsupported = {f"{name}.env={self.env}": self.env is not None,
                   f"{name}.placement={self.placement}": self.placement != "colocated"}  # fmt: skip
    refused = [what for what, bad in unsupported.items() if bad]
    if mode == "bounded" and refused:
        raise ConfigError(f"{name}.async_rollout=bounded samples colocated single-turn rollouts "
                          f"only (not {refused[0]})")  # fmt: skip
