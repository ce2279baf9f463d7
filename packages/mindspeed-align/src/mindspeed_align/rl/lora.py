"""LoRA in RL (`--lora.rank` with grpo, dapo, ppo): what the roles around an adapter-only
policy do differently.

- The reference is the policy itself with its adapters off (`BaseReference`): the base's
  log-probs from the same weights, with no second copy of the model (TRL's GRPO and peft's
  `disable_adapter()` do the same). The LoRA base is frozen, so it is the starting policy.
- The native rollout's copy and the Ray rollout actor carry the same adapters: they get the
  base once and the adapter tensors every step (`rollout.LocalRollout`,
  `placement._RayRollout`), so `rollout/weight_sync_bytes` is the adapters' size.
- vLLM's engine (`vllm_rollout.VLLMRollout`) loads plain Hugging Face weights: it gets the
  policy's merged weights, W + scaling B A, every step (`merged_policy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor, nn

from mindspeed_align.rl.reference import LocalReference
from mindspeed_llm.data.collate import Batch
from mindspeed_llm.peft import LoRAConfig, adapters_disabled, merged_state
from mindspeed_llm.train.build import BuiltModel

__all__ = ["BaseReference", "MergedWeights", "merged_policy"]


class BaseReference(LocalReference):
    """The reference of a LoRA run: the policy (`BuiltModel`) with every adapter bypassed."""

    def submit(self, batches: list[Batch], temperature: float) -> Callable[[], list[Tensor]]:
        scores = super().submit(batches, temperature)

        def base_logps() -> list[Tensor]:
            with adapters_disabled(self.model.model):
                return scores()

        return base_logps


class MergedWeights(nn.Module):
    """A LoRA policy seen through its merged weights: `state_dict()` is the base's names
    with every adapter folded in (whole tensors), its parameters the policy's."""

    def __init__(self, policy: nn.Module, scaling: float):
        super().__init__()
        self.policy, self.scaling = policy, scaling

    def state_dict(self, *args, **kwargs) -> dict[str, Tensor]:
        from mindspeed_align.rl.rollout import whole_weights

        return merged_state(dict(whole_weights(self.policy)), self.scaling)


def merged_policy(policy: BuiltModel, lora: LoRAConfig) -> BuiltModel:
    """`policy` whose model gives merged weights (for a rollout engine without adapters)."""
    return dataclasses.replace(policy, model=MergedWeights(policy.model, lora.scaling))
