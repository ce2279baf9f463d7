"""Rollouts: `n` samples per prompt from `mindspeed_llm.generation`, with the sampler's
log-probs, and the teacher-forced log-probs the loss uses.

The rollout runs `TokenSteps` (KV cache, no gradients) on the policy module itself when
its parameters are plain tensors (one process, or data parallel by replication), or on
an inference copy whose weights are gathered from the FSDP/TP shards (`sync_weights`,
timed). A LoRA policy's copy carries the same adapters: its first sync copies the base and
the adapters, later ones the adapters alone (the base is frozen), so a step moves the
adapters' bytes (`last_bytes`), not the model's. Every prompt is prefilled once and its KV
cache shared by its `n` sample rows (they draw what `n` repeated prompts would); the
sampling seed mixes the run's seed, the step and the data-parallel rank, so dp ranks draw
different samples and a rerun draws the same ones, while tensor-parallel peers (same
prompts, same seed) agree.

The log-probs the policy loss uses as "old" ones are not the sampler's: the trainer
recomputes them with a teacher-forced forward of the training model (verl's recomputed
old_log_prob), so rollout/trainer mismatch cannot bias the ratio; the sampler's are kept
to report the mismatch (`sampler_logprobs`, raw softmax(logits / T) before any top-k).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import dtensor
from mindspeed_llm.generation import GenerationConfig, TokenSteps
from mindspeed_llm.generation.kv_cache import KVCache
from mindspeed_llm.models import get_model_spec
from mindspeed_llm.train.build import BuiltModel

__all__ = [
    "LocalRollout",
    "RolloutBatch",
    "SamplingConfig",
    "plain_key",
    "sampling_seed",
    "whole_weights",
]


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    n: int = 8
    """Samples per prompt (GRPO's group size)."""
    max_new_tokens: int = 16
    """New tokens per sample at most."""
    temperature: float = 1.0
    """softmax(logits / temperature); no top-k/top-p, so the loss sees the sampler's law."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample (kept as its last token)."""
    kv_budget_mb: float = 0.0
    """The KV cache of one decoding batch at most (MiB, this rank); prompts are decoded in
    chunks that fit (0: all at once)."""


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]
    """One per sample (each prompt repeated n times, consecutively)."""
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    """log softmax(logits / T) of each sampled token, from the sampler's own logits."""
    group: list[int]
    """The prompt index of each sample."""
    stopped: list[bool]
    """The sample ended with a stop token (else it ran to max_new_tokens)."""
    seconds: float = 0.0
    response_mask: list[list[int]] | None = None
    """Per response token, 1 where the policy sampled it and 0 where an environment wrote
    it (multi-turn episodes, `env.run_episodes`); None: every token is the policy's."""
    token_syncs: list[list[int]] | None = None
    """Per response token, how many weight syncs the sampler had received when it drew it
    (`LocalRollout.syncs`): a sample whose generation outlived a sync carries two values (a
    partial rollout, `async_rollout.BoundedRollouts`). None: the sampler does not say."""


def plain_key(name: str) -> str:
    """A training model's state-dict key as a plain model's (no activation-checkpoint or
    torch.compile wrapper in it)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def whole_weights(model: nn.Module, *, adapters_only: bool = False):
    """(plain name, whole tensor) of every entry of `model`'s state dict (DTensors gathered);
    with `adapters_only`, of its LoRA adapters alone (what a copy holding the frozen base
    already needs each step)."""
    for name, value in model.state_dict().items():
        if adapters_only and ".lora_" not in name:
            continue
        yield plain_key(name), dtensor.full(value) if isinstance(value, DTensor) else value


def sampling_seed(seed: int, step: int, dp_rank: int) -> int:
    """A 62-bit seed, different for every (seed, step, dp_rank)."""
    mixed = (seed * 0x9E3779B1 + step * 0x85EBCA77 + dp_rank * 0xC2B2AE3D) & ((1 << 62) - 1)
    return mixed or 1


class SamplerLogProbs:
    """A `TokenSteps.on_logits` hook: `last` holds log softmax(logits / T) of the last logits
    the sampler drew from (rows: the steps' `active` rows)."""

    def __init__(self, temperature: float):
        self.temperature = temperature or 1.0
        self.last: Tensor | None = None

    def __call__(self, logits: Tensor) -> None:
        self.last = torch.log_softmax(logits.float() / self.temperature, dim=-1)


class LocalRollout:
    """Colocated rollout on this rank.

    Args:
        policy: the training model (its module is used as is when unsharded).
        copy: roll out through a whole copy even when the policy is unsharded (one-step
            off-policy rollouts sample while the policy trains).
        lora: the policy's adapters (`LoRAConfig`, rank > 0), which a copy gets too.

    `sync_weights` and each decoding step of `generate` hold a lock: a rollout running in
    a background thread sees the weights change between two of its tokens, never inside
    one, and tags every token with the syncs it had seen (`RolloutBatch.token_syncs`), so
    a partial rollout knows which weights drew each token.
    """

    def __init__(self, policy: BuiltModel, *, copy: bool = False, lora=None):
        if policy.model is None:
            raise ValueError("a pipelined policy cannot roll out; RL refuses parallel.pp > 1")
        self.policy = policy
        sharded = any(isinstance(p, DTensor) for p in policy.model.parameters())
        self.module: nn.Module = policy.model
        if sharded or copy:  # a whole copy, filled from the policy by sync_weights
            with torch.device(policy.device):
                self.module = get_model_spec(policy.config.family).build(policy.config)
            if lora is not None and lora.enabled:
                from mindspeed_llm.peft import apply_lora

                apply_lora(self.module, lora)
            self.module.requires_grad_(False).eval()
        self.copy = sharded or copy
        self.adapters_only = False
        """The copy holds the policy's frozen base: later syncs copy the adapters alone."""
        self.lora = lora is not None and lora.enabled
        self.lock = threading.Lock()
        self._no_sync = threading.Event()
        """Cleared while a sync waits: decoding steps let it in (a lock is not fair: a
        decoding loop that releases and retakes it would starve the sync for a whole
        rollout)."""
        self._no_sync.set()
        self.last_bytes = 0
        """Bytes the last `sync_weights` copied."""
        self.syncs = 0
        """How many times `sync_weights` copied the policy's weights in."""

    @torch.no_grad()
    def sync_weights(self) -> float:
        """Copies the policy's current weights (a LoRA policy's adapters alone after the
        first time) into the rollout module; seconds taken (0 when the rollout uses the
        policy module itself)."""
        if not self.copy:
            return 0.0
        self._no_sync.clear()
        try:
            return self._copy_weights()
        finally:
            self._no_sync.set()

    def _copy_weights(self) -> float:
        with self.lock:
            start = time.perf_counter()
            target = self.module.state_dict()
            self.last_bytes = 0
            for key, value in whole_weights(self.policy.model, adapters_only=self.adapters_only):
                if key in target:
                    target[key].copy_(value)
                    self.last_bytes += target[key].numel() * target[key].element_size()
            self.syncs += 1
            self.adapters_only = self.lora
            return time.perf_counter() - start

    def generate(
        self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *, seed: int
    ) -> RolloutBatch:
        """`cfg.n` samples of every prompt (each prompt prefilled once, its KV cache shared),
        in chunks of prompts whose KV cache fits `cfg.kv_budget_mb` (chunk k draws with
        seed + k)."""
        start = time.perf_counter()
        out = RolloutBatch([], [], [], [], [], token_syncs=[])
        size = self._prompts_per_chunk(prompts, cfg)
        for k, lo in enumerate(range(0, len(prompts), size)):
            chunk = self._generate(prompts[lo : lo + size], cfg, seed + k)
            out.token_syncs += chunk.token_syncs
            out.prompt_ids += chunk.prompt_ids
            out.response_ids += chunk.response_ids
            out.sampler_logprobs += chunk.sampler_logprobs
            out.group += [lo + g for g in chunk.group]
            out.stopped += chunk.stopped
        out.seconds = time.perf_counter() - start
        return out

    def _prompts_per_chunk(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig) -> int:
        if not cfg.kv_budget_mb:
            return len(prompts)
        return self.prompts_within_budget(max(len(p) for p in prompts), cfg)

    def prompts_within_budget(self, prompt_len: int, cfg: SamplingConfig) -> int:
        """How many prompts of `prompt_len` tokens (with their n samples) one decoding batch
        within `cfg.kv_budget_mb` holds.

        Raises:
            ConfigError: not even one.
        """
        length = prompt_len + cfg.max_new_tokens
        row_mb = KVCache.bytes_per_position(self.module) * length / 2**20
        fits = int(cfg.kv_budget_mb // (row_mb * cfg.n))
        if fits < 1:
            raise ConfigError(
                f"rollout KV budget of {cfg.kv_budget_mb:g} MiB cannot hold one prompt's "
                f"{cfg.n} samples of {length} tokens ({row_mb * cfg.n:.3g} MiB)"
            )
        return fits

    def _generate(self, prompts, cfg: SamplingConfig, seed: int) -> RolloutBatch:
        rows = [list(p) for p in prompts for _ in range(cfg.n)]
        gen = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            stop_token_ids=cfg.stop_token_ids,
            seed=seed,
            num_return_sequences=cfg.n,
        )
        logps = SamplerLogProbs(cfg.temperature)
        steps = TokenSteps(self.module, prompts, gen, on_logits=logps)
        logprobs: list[list[float]] = [[] for _ in rows]
        syncs: list[list[int]] = [[] for _ in rows]
        tokens = iter(steps)
        with torch.no_grad():
            while True:
                self._no_sync.wait()
                with self.lock:  # one decoding step (its forward and draw) on fixed weights
                    new, version = next(tokens, None), self.syncs
                if new is None:
                    break
                position = {row: i for i, row in enumerate(steps.active)}  # rows of logps.last
                picked = logps.last[[position[r] for r, _ in new], [t for _, t in new]].tolist()
                for (row, _), lp in zip(new, picked, strict=True):
                    logprobs[row].append(lp)
                    syncs[row].append(version)
        stops = set(cfg.stop_token_ids)
        return RolloutBatch(
            prompt_ids=rows,
            response_ids=steps.outputs,
            sampler_logprobs=logprobs,
            group=[i for i in range(len(prompts)) for _ in range(cfg.n)],
            stopped=[bool(out) and out[-1] in stops for out in steps.outputs],
            token_syncs=syncs,
        )
