"""`mindspeed ppo`: PPO with a critic (GAE) on the shared engine.

One training step = one rollout (ppo.epochs x ppo.mini_batches updates, 1 x 1 by default), as
in `grpo`, with a second model, the critic (the
policy's decoder with a one-output value head, `reward.add_score_head`, its own AdamW):

    sample ppo.n completions per prompt; rewards (+ DAPO's overlong penalty)
    pack; old log-probs (policy), reference log-probs, old values (critic): teacher-forced
    token rewards: the score on each response's last token, minus ppo.kl_coef x KL per
        token when ppo.kl_in_reward (TRL's PPO, verl's use_kl_in_reward)
    GAE per response (ppo.gamma, ppo.lam), whitened over every response token of the step
        on every data-parallel rank; returns = advantages before whitening + old values
    critic step: clipped value loss (critic.value_clip) against the returns
    policy step: the clipped surrogate of `GRPOObjective` on the whitened advantages

The value of a response token is the critic's output at the position that predicts it
(TRL's `values[:, context_length - 1 : -1]`). Both steps see the same micro-batches;
the critic's model, optimizer and schedule are checkpointed beside the policy's
(`critic_model`, `critic_optimizer`, ...), so a run resumes exactly.

The critic trains in the training processes (`LocalCritic`), or, with `ppo.placement: ray`, on
Ray actors of its own: one per training rank, in a process group of the critic actors alone,
on the run's layout (`ray_groups.place_critic`). Each training rank asks its actor for the
old values of its micro-batches and sends it the update of each mini-batch; checkpoints fetch
and send the actors' states (whole tensors) under the same names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mindspeed_align.reward import add_score_head
from mindspeed_align.rl import advantages as adv_fns
from mindspeed_align.rl.grpo import GRPOMethod, GRPOStep, combine_results
from mindspeed_align.rl.losses import kl_estimate, value_loss
from mindspeed_align.rl.ray_groups import place_critic
from mindspeed_align.rl.weights import load_value_model
from mindspeed_core.parallel import loss_parallel_context
from mindspeed_core.parallel.dtensor import full
from mindspeed_llm.data.collate import IGNORE_INDEX, Batch, forward_packed
from mindspeed_llm.train.build import BuiltModel, build_model, build_train_parts
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective, RunContext
from mindspeed_llm.train.start import StartingWeights, starting_model
from mindspeed_llm.train.step import StepResult, TrainStep

__all__ = ["LocalCritic", "PPOStep", "ValueObjective", "PPOMethod", "build_critic", "packed_gae",
           "ppo_advantages", "recompute_values", "whiten_over_ranks"]  # fmt: skip


class ValueObjective(Objective):
    """The critic's loss: `losses.value_loss` summed over the response tokens (the units:
    token-mean, verl's default). Metrics: clip fraction, mean value, mean return."""

    metric_names = ("vf_clip_fraction", "values", "returns")

    def __init__(self, clip: float | None = 0.2):
        self.clip = clip

    def num_units(self, batch: Batch) -> Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def targets(self, batch: Batch) -> dict[str, Tensor]:
        return {k: batch[k] for k in ("labels", "old_values", "returns")}

    def loss(self, outputs: Tensor, targets: dict[str, Tensor], ctx: LossContext) -> LossOutput:
        values = full(outputs).float().flatten()  # (batch * seq,): one output per position
        mask = (targets["labels"].flatten() != IGNORE_INDEX).float()
        returns = targets["returns"].flatten()
        per_token, clipped = value_loss(values, targets["old_values"].flatten(), returns,
                                        clip=self.clip)  # fmt: skip
        metrics = {
            "vf_clip_fraction": (clipped * mask).sum(),
            "values": (values.detach() * mask).sum(),
            "returns": (returns * mask).sum(),
        }
        return LossOutput((per_token * mask).sum(), metrics)


@torch.no_grad()
def recompute_values(critic: BuiltModel, batch: Batch) -> Tensor:
    """The critic's value at every position of `batch`, shaped like input_ids (fp32, CPU)."""
    b = {k: v.to(critic.device) for k, v in batch.items()}
    with contextlib.ExitStack() as stack:
        if critic.autocast is not None:
            stack.enter_context(torch.autocast(critic.device.type, dtype=critic.autocast))
        stack.enter_context(loss_parallel_context(False))
        out = forward_packed(critic.model, b)
    return full(out).float().view_as(b["input_ids"]).cpu()


def _response_index(batch: Batch) -> tuple[Tensor, Tensor]:
    """(samples, longest response) flat positions of each sample's response tokens in the
    packed row, and their mask (each response is contiguous, one document each)."""
    supervised = batch["labels"].flatten() != IGNORE_INDEX
    bounds = batch["cu_seqlens"].tolist()
    spans = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        positions = supervised[lo:hi].nonzero().flatten() + lo
        if positions.numel():
            spans.append(positions)
    width = max((len(s) for s in spans), default=0)
    index = torch.zeros(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for i, positions in enumerate(spans):
        index[i, : len(positions)], mask[i, : len(positions)] = positions, True
    return index, mask


def packed_gae(token_rewards: Tensor, values: Tensor, batch: Batch, *, gamma: float, lam: float):
    """GAE (`advantages.gae`, not whitened) of each response of a packed row.

    Args:
        token_rewards / values: per position, shaped like input_ids (read at the response
            tokens' label positions).
        batch: the packed row (labels, cu_seqlens).

    Returns:
        (advantages, returns), shaped like input_ids, 0 outside the responses.
    """
    index, mask = _response_index(batch)
    flat_r, flat_v = token_rewards.flatten().double(), values.flatten().double()
    adv, ret = adv_fns.gae(flat_r[index] * mask, flat_v[index] * mask, mask.double(),
                           gamma=gamma, lam=lam, whiten=False)  # fmt: skip
    out_adv, out_ret = torch.zeros_like(flat_r), torch.zeros_like(flat_r)
    out_adv[index[mask]], out_ret[index[mask]] = adv[mask], ret[mask]
    shape = batch["labels"].shape
    return out_adv.float().view(shape), out_ret.float().view(shape)


def whiten_over_ranks(batches: list[Batch], key: str, mesh) -> None:
    """`batches[*][key]` whitened in place over every response token of every batch and
    data-parallel rank ((x - mean) / sqrt(unbiased var + 1e-8), verl's `masked_whiten`)."""
    masks = [b["labels"] != IGNORE_INDEX for b in batches]
    values = torch.cat([b[key][m] for b, m in zip(batches, masks, strict=True)]).double()
    stats = torch.stack([values.sum(), values.square().sum(),
                         torch.tensor(float(values.numel()), dtype=torch.float64)])  # fmt: skip
    if mesh is not None:
        stats = stats.to(mesh.device_type)
        dist.all_reduce(stats, group=mesh.get_group())
    total, total_sq, count = stats.cpu().tolist()
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0) * count / max(count - 1, 1)
    for b, m in zip(batches, masks, strict=True):
        b[key] = torch.where(m, (b[key] - mean) / (var + 1e-8) ** 0.5, torch.zeros_like(b[key]))


def ppo_advantages(micro: list[Batch], values: Callable[[list[Batch]], list[Tensor]], rl,
                   dp_mesh) -> tuple[float, float]:  # fmt: skip
    """Into each packed micro-batch (with "scores" on each response's last token, old and
    reference log-probs): the critic's old values, GAE advantages (whitened over the step's
    response tokens on every rank of `dp_mesh` when rl.whiten_advantages) and returns.

    Args:
        values: the critic's values of the micro-batches (`LocalCritic.values`).
        rl: the `ppo` section (gamma, lam, kl_coef, kl_in_reward, kl_estimator, whiten).

    Returns:
        (sum, count) of the per-token KL in the reward on this rank ((0, 0) without one).
    """
    kl_sum, kl_count = 0.0, 0.0
    for b, old_values in zip(micro, values(micro), strict=True):
        b["old_values"] = old_values
        rewards = b.pop("scores")
        supervised = b["labels"] != IGNORE_INDEX
        if rl.kl_in_reward and rl.kl_coef:
            kl = kl_estimate(b["old_logps"], b["ref_logps"], rl.kl_estimator) * supervised
            rewards = rewards - rl.kl_coef * kl
            kl_sum, kl_count = kl_sum + kl.sum().item(), kl_count + supervised.sum().item()
        advantages, b["returns"] = packed_gae(rewards, b["old_values"], b,
                                              gamma=rl.gamma, lam=rl.lam)  # fmt: skip
        if rl.advantage == "gae":  # else the outcome estimator's, packed in already
            b["advantages"] = advantages
    if rl.whiten_advantages and rl.advantage == "gae":
        whiten_over_ranks(micro, "advantages", dp_mesh)
    return kl_sum, kl_count


class PPOStep(GRPOStep):
    """`GRPOStep` with a critic: GAE advantages, then a critic step and a policy step on the
    same micro-batches (see the module docstring); with ppo.epochs / ppo.mini_batches, a
    critic update and a policy update per mini-batch."""

    def __init__(self, *args, critic: LocalCritic, **kwargs):
        super().__init__(*args, **kwargs)
        self.critic = critic

    def __call__(self, records: list[dict[str, Any]]) -> StepResult:
        rollout = self._sample(records)
        scores = [[0.0] * (n - 1) + [r] for r, n in zip(rollout.rewards, rollout.lengths, strict=True)]
        # GAE fills the advantages in below; another estimator's come from the outcomes
        advantages = [[0.0] * n for n in rollout.lengths] if self.rl.advantage == "gae" else (
            adv_fns.token_advantages(self.rl.advantage, rollout.rewards, rollout.batch.group,
                               rollout.lengths, eps=self.rl.std_eps))  # fmt: skip
        keep = list(range(len(scores)))
        micro, mismatch = self._micro_batches(rollout.batch, {"scores": scores, "advantages": advantages},
                                              keep)  # fmt: skip
        kl_sum, kl_count = ppo_advantages(micro, self.critic.values, self.rl, self.dims.mesh("dp"))
        critics = []

        def update(mini: list[Batch], last: bool) -> StepResult:
            critics.append(self.critic(mini, schedule=last))
            return self.train(mini, schedule=last)

        result = self.updates(rollout.batch, micro, keep, update)
        critic = critics[0] if len(critics) == 1 else combine_results(critics, [0] * len(critics))
        result.metrics.update(self._rollout_metrics(rollout, len(keep), mismatch))
        if self.rl.kl_in_reward:  # the objective's KL is 0: report the reward's
            result.metrics["kl"] = self._dp_sum(kl_sum) / max(self._dp_sum(kl_count), 1.0)
        result.metrics.update({"critic/loss": critic.loss, "critic/grad_norm": critic.grad_norm,
                               **{f"critic/{k}": v for k, v in critic.metrics.items()}})  # fmt: skip
        return result

    def _dp_sum(self, value: float) -> float:
        mesh = self.dims.mesh("dp")
        if mesh is None:
            return value
        tensor = torch.tensor(value, dtype=torch.float64, device=mesh.device_type)
        dist.all_reduce(tensor, group=mesh.get_group())
        return tensor.item()


class LocalCritic:
    """The critic's `TrainStep` in this process: `values(batches)` (the old values) and
    `critic(mini, schedule=)` (an update); `states`, its checkpoint `Stateful`s."""

    def __init__(self, step: TrainStep, states: dict[str, Any]):
        self.step, self.states = step, states

    def values(self, batches: list[Batch]) -> list[Tensor]:
        return [recompute_values(self.step.model, b) for b in batches]

    def __call__(self, mini: list[Batch], *, schedule: bool = True) -> StepResult:
        return self.step(mini, schedule=schedule)


def _critic(cfg, dims, device, build: Callable[..., BuiltModel], init_from) -> LocalCritic:
    """The critic's model (the policy's body and a value head, built by `build` on the run's
    layout), optimizer and step."""
    parallel = dataclasses.replace(cfg.parallel, loss_parallel=False)  # one output: no vocab
    # the policy's starting body and a new value head, or a trained reward model's both
    start = None if cfg.critic.init_from is not None or init_from is None else (
        StartingWeights(path=init_from, key=f"{cfg.rl.section}.init_from"))  # fmt: skip
    model = starting_model(build, start, frozen=False, head=False, parallel=parallel,
                           ac=cfg.train.ac, before_tp=add_score_head, compile=cfg.train.compile,
                           cuda_graphs=cfg.train.cuda_graphs, fp8=cfg.train.fp8)  # fmt: skip
    if cfg.critic.init_from is not None:
        load_value_model(model, cfg.critic.init_from)
    parts = build_train_parts(model, cfg.critic, total_steps=cfg.train.steps,
                              precision=cfg.train.precision)  # fmt: skip
    states = {k: v for k, v in parts.states(None, device).items() if k != "rng"}
    step = TrainStep(parts, ValueObjective(cfg.critic.value_clip), dims,
                     clip_grad=cfg.critic.clip_grad,
                     max_nonfinite_steps=cfg.train.max_nonfinite_steps)  # fmt: skip
    return LocalCritic(step, states)


def critic_on_actor(cfg, info, *, model_config, init_from) -> LocalCritic:
    """The critic as a critic actor builds it (`ray_groups._CriticWorker`), in the process
    group of the critic actors (`info`): the run's layout, seed, precision and sequence
    length, as `Trainer.build_model` gives the colocated one."""
    dims = cfg.parallel.dims()
    dims.build(info.device.type)
    run = {"precision": cfg.train.precision, "seed": cfg.train.seed, "seq_len": cfg.data.seq_len,
           "hf_path": cfg.model.hf_path}  # fmt: skip
    return _critic(cfg, dims, info.device,
                   lambda **options: build_model(model_config, dims, info.device, **{**run, **options}),
                   init_from)  # fmt: skip


def build_critic(run: RunContext, cfg, init_from, roles=None):
    """The critic: on this rank (`LocalCritic`), or on a Ray actor of `roles` (a
    `placement.RayRoles`); its states join the run's checkpoints under `critic_*`."""
    if roles is not None:
        critic = place_critic(roles, cfg, functools.partial(critic_on_actor, model_config=run.model_config,
                                                     init_from=init_from))  # fmt: skip
    else:
        critic = _critic(cfg, run.dims, run.device, run.build_model, init_from)
    run.add_states({f"critic_{k}": v for k, v in critic.states.items()})
    return critic


class PPOMethod(GRPOMethod):
    """PPO as a `Trainer`'s objective: GRPO's roles and a critic (built first, so its weights
    are drawn where they always were), stepped by `PPOStep`."""

    step_cls = PPOStep

    def setup(self, run: RunContext) -> None:
        self.critic = build_critic(run, self.cfg, self.init_from, self.roles)
        super().setup(run)

    def step_extras(self) -> dict[str, Any]:
        return {"critic": self.critic}
