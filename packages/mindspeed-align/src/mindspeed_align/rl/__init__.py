"""Online RL for LLMs (GRPO and relatives): advantages, policy losses, rewards, rollouts.

The math is pure functions (`advantages`, `losses`); `rewards` scores completions with
Python callables in worker processes; `rollout` samples with `mindspeed_llm.generation`;
`grpo` is the `mindspeed grpo` trainer on the shared engine (`mindspeed_llm.train`).
"""
