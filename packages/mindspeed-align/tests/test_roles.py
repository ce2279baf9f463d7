"""Every implementation of an RL role answers its protocol's calls (`rl/roles.py`), with
the same parameters, whether it runs colocated or on a Ray actor."""

import inspect

import pytest

from mindspeed_align.rl import placement, ppo, ray_groups, roles
from mindspeed_align.rl.rewards import Rewards
from mindspeed_align.rl.rollout import LocalRollout
from mindspeed_align.rl.vllm_group import SharedVLLMRollout
from mindspeed_align.rl.vllm_rollout import VLLMRollout

IMPLEMENTATIONS = {
    roles.Rollout: [LocalRollout, placement._RayRollout, VLLMRollout, SharedVLLMRollout],
    roles.Reference: [placement.LocalReference, placement._RayReference],
    roles.RewardScorer: [Rewards, placement._RayRewards],
    roles.Critic: [ppo.LocalCritic, ray_groups._RayCritic],
}


def _methods(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items()
            if callable(value) and (not name.startswith("_") or name == "__call__")]  # fmt: skip


def _params(fn) -> list[tuple[str, object, bool]]:
    """(name, kind, has a default) of each parameter after self."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in params]


def _mismatches(protocol, cls) -> list[str]:
    """What `cls` lacks or spells differently of `protocol`'s methods."""
    problems = []
    for method in _methods(protocol):
        if not any(method in vars(base) for base in cls.__mro__[:-1]):
            problems.append(f"{cls.__name__} lacks {method}")
        elif _params(getattr(cls, method)) != _params(getattr(protocol, method)):
            problems.append(f"{cls.__name__}.{method} takes {_params(getattr(cls, method))}")
    return problems


CASES = [(protocol, cls) for protocol, classes in IMPLEMENTATIONS.items() for cls in classes]


@pytest.mark.parametrize("protocol,cls", CASES, ids=[c.__name__ for _, c in CASES])
def test_implementation_answers_the_protocol(protocol, cls):
    assert _mismatches(protocol, cls) == []


def test_the_protocols_declare_the_calls_the_step_makes():
    # the attributes the step reads beyond the methods
    assert roles.Rollout.__annotations__.keys() >= {"last_bytes"}
    assert roles.Critic.__annotations__.keys() >= {"states"}
    assert {m for p in IMPLEMENTATIONS for m in _methods(p)} == {
        "sync_weights", "generate", "prompts_within_budget", "submit", "__call__", "close",
        "values",
    }  # fmt: skip


def test_a_drifted_implementation_is_caught():
    class Drifted:
        def sync_weights(self) -> float:
            return 0.0

        def generate(self, prompts, cfg, seed):  # seed no longer keyword-only
            return None

    problems = _mismatches(roles.Rollout, Drifted)
    assert problems[0].startswith("Drifted.generate takes")
    assert problems[1] == "Drifted lacks prompts_within_budget"
