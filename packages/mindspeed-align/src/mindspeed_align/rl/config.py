"""`mindspeed grpo`'s and `mindspeed ppo`'s configurations: pretraining's shared sections plus
`data` (prompts) and the algorithm's section (`grpo`; `ppo` and `critic`). Defaults are the
embedded demos (the debug Llama on the arithmetic of the pretrain demo's stories, CPU, a few
minutes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mindspeed_align.rl.config_checks import check_grpo_section
from mindspeed_align.rl.losses import POLICY_LOSSES
from mindspeed_core.checkpoint import CheckpointConfig
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.profiling import ProfileConfig
from mindspeed_llm.peft.lora import LoRAConfig
from mindspeed_llm.train.config import LoggingSection, ModelSection, TrainSection


@dataclass(kw_only=True)
class PromptDataSection:
    prompts: Path | None = None
    """JSONL, one record a line: {"prompt": str, ...}; the other fields (e.g. "answer")
    go to the reward functions. None: the demo task (generated)."""
    tokenizer: Path | None = None
    """A sentencepiece .model, a tokenizer.json or a folder (None: the demo's)."""
    chat_template: str | None = None
    """How {"messages": [...]} records become prompt text: a template name (qwen, qwen3,
    llama2, llama3, chatml, mistral, deepseek3, glm4, gemma, phi3), a .jinja file, or
    None: the tokenizer folder's own (ChatML when it has none); rendered with the
    generation prompt. When set, {"prompt": ...} records are rendered too, as one user
    turn (unset: they stay raw text, as the demo's)."""
    seq_len: int = 64
    """Longest prompt + grpo.max_new_tokens; a longer prompt is refused at load."""
    eval_prompts: int = 64
    """Held-out prompts (the file's last ones, or fresh demo ones) whose greedy reward is
    printed before and after training (0: none)."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be at least 2")


@dataclass(kw_only=True)
class GRPOSection:
    n: int = 8
    """Samples per prompt (the group); >= 2 for group advantages."""
    temperature: float = 1.0
    """Sampling temperature; the loss's log-probs are of softmax(logits / temperature)."""
    max_new_tokens: int = 4
    """New tokens per sample at most."""
    rollout_kv_mb: float = 0.0
    """KV cache memory of one decoding batch at most (MiB, per rank): the rollout decodes
    its prompts in chunks that fit (0: all at once)."""
    advantage: str = "grpo"
    """grpo: (r - mean) / (std + eps) per group; dr_grpo: r - mean; rloo: r - mean of
    the others; reinforce_pp: r whitened over the batch's tokens; gae: GAE with a critic
    (`mindspeed ppo` only); or any estimator registered with
    `mindspeed_align.rl.advantages.register_advantage`."""
    std_eps: float = 1e-6
    """eps of grpo's std (verl 1e-6, TRL 1e-4)."""
    loss: str = "ppo_clip"
    """The policy loss: ppo_clip (PPO's clipped surrogate per token, verl's "vanilla");
    gspo (GSPO's sequence-level ratio, arXiv 2507.18071); cispo (CISPO's clipped,
    detached importance weight times log-prob, arXiv 2506.13585); or any loss registered
    with `mindspeed_align.rl.losses.register_policy_loss`. Each brings its own defaults
    for clip_low, clip_high and loss_agg."""
    clip_low: float | None = None
    """Ratio clip below: 1 - clip_low (None: the loss's: ppo_clip 0.2, gspo 3e-4, cispo
    1.0, i.e. no lower bound)."""
    clip_high: float | None = None
    """Ratio clip above: 1 + clip_high (None: the loss's: ppo_clip 0.2, gspo 4e-4, cispo
    4.0; DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (verl: 3.0; ppo_clip only); None: off."""
    rollout_correction_cap: float | None = None
    """Truncated importance sampling (TIS) of the rollout/trainer mismatch: the policy loss
    of each token times min(exp(old_logp - sampler_logp), cap), the sampler's log-probs
    being the rollout's own (verl's rollout_correction / tis_imp_ratio_cap, e.g. 2.0; TRL's
    vllm_importance_sampling_clip_max 3.0). None: off."""
    kl_coef: float = 0.0
    """KL penalty in the loss against the starting model (0: no reference is built)."""
    recompute_old_logps: bool = False
    """Old log-probs of the ratio from a teacher-forced forward before the step (verl's
    recompute); false: the training forward's own, detached (TRL's on-policy shortcut: one
    update per rollout gives the same numbers with one forward fewer). The rollout/trainer
    mismatch is measured either way."""
    epochs: int = 1
    """Passes over each rollout's samples (verl's and TRL's PPO `ppo_epochs`, TRL's GRPO
    `num_iterations`). More than one pass (or mini-batch) fixes the old log-probs before
    the first update (as if recompute_old_logps), so the ratio moves off 1 after it."""
    mini_batches: int = 1
    """Optimizer updates per pass: each rank's samples of the step, shuffled per pass, in
    this many mini-batches (verl's ppo_mini_batch_size = samples / mini_batches). The LR
    schedule counts training steps (rollouts), not updates."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    loss_agg: str | None = None
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm
    (None: the loss's: token-mean, gspo's seq-mean-token-mean)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (they carry no gradient)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: responses longer than max_new_tokens - overlong_buffer
    lose up to `overlong_penalty` of reward, linearly to the limit (0: off)."""
    overlong_penalty: float = 1.0
    """The most a response at max_new_tokens loses (verl's penalty_factor)."""
    rewards: list[str | dict[str, Any]] = field(default_factory=lambda: ["final_number"])
    """Reward functions, "module:function" (bare names: mindspeed_align.rl.rewards), and
    mappings: `{judge: URL, model: NAME, ...}` an OpenAI-compatible LLM judge
    (`rl.judge.JudgeReward`), `{code: FIELD, ...}` the reply's code run against the record's
    tests in the sandbox (`rl.code_reward.CodeReward`)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (default 1.0 each)."""
    reward_model: Path | None = None
    """A reward model scoring prompt + completion beside the rule rewards: a Hugging Face
    *ForSequenceClassification folder (`mindspeed rm --rm.export_hf`); None: rules only."""
    reward_model_weight: float = 1.0
    """Its weight in the sum of rewards."""
    placement: Literal["colocated", "ray"] = "colocated"
    """Where the rollout, the reference and the rewards run: in the training processes, or
    as Ray actors (`mindspeed-align[ray]`; a local cluster for one process, RAY_ADDRESS's
    for several; the rollout actor gets the policy's weights every step). The policy and
    PPO's critic train in the training processes."""
    trainer_actors: int = 0
    """With placement ray: this many Ray actors train the policy, as one torch.distributed
    group of their own (the launching process only starts them and waits; each actor
    places its own rollout, reference and reward actors). 0: the launching process (or
    torchrun job) trains."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """With placement ray: what each actor holding a model (rollout, reference, PPO's
    critic, the trainer actors) asks the cluster for besides its CPU: `{GPU: 1}` (Ray's
    num_gpus) on a GPU cluster, `{NPU: 1}` (a custom resource the nodes declare) on
    Ascend. {}: CPU only. The reward actor asks for one CPU."""
    reward_workers: int = 2
    """Worker processes for the rewards (0: in this process, no timeout)."""
    reward_timeout_s: float = 10.0
    """Seconds a reward may take per completion; past it the completion scores 0."""
    init_from: Path | None = None
    """Start from these weights (a run's checkpoints, a converted checkpoint or a
    Hugging Face folder); the KL reference is them too. None: model.hf_path or the
    demo's warm-up model (the default demo) or a random init."""
    warmup_steps: int = 150
    """Demo only (no data.prompts, no init_from, no model.hf_path): pretraining steps on
    the demo corpus first, so the model speaks the task's format (with env calculator:
    SFT steps on the calculator's demonstrations, 1500 when left at 150)."""
    shared_prompts: Literal["auto", "on", "off"] = "auto"
    """The n completions of a prompt packed after one copy of it, each attending to its keys
    (`objective.pack_samples(share_prompts=True)`): the prompt's forward and backward run
    once per group in the policy's, the old log-probs' and the reference's forwards. auto:
    where it can run (no pipeline or context parallel, softmax attention layers, no MTP);
    on: refused elsewhere."""
    async_rollout: Literal["off", "one_step", "bounded"] = "off"
    """one_step: the rollout of step k+1 samples (in a background thread, through a copy of
    the policy as step k starts) while step k trains; each step trains on samples of the
    policy one update old, with the ratio against the sampler's log-probs (verl's and
    AReaL's one-step off-policy). `rollout/staleness` logs the lag (0 on the first step and
    after a resume, which sample synchronously). bounded: rollouts of up to max_staleness
    steps ahead sample in the background, their weights synced every step even mid-sample
    (partial rollouts; on vLLM a sync waits for the call in flight instead), each token
    tagged with the policy version that drew it; groups more
    than max_staleness versions stale are dropped (`rl/async_rollout.py`; metrics
    `rollout/staleness_mean`, `rollout/staleness/<k>`, `rollout/dropped`,
    `rollout/partial`). off: sample, then train."""
    max_staleness: int = 1
    """With async_rollout bounded: the most policy versions (optimizer steps) between the
    weights that drew a sample's oldest token and the step that trains on it."""
    env: str | None = None
    """Multi-turn episodes in an environment instead of one completion per prompt:
    "calculator" (the embedded tool-use demo: `mindspeed grpo --env calculator`) or
    "module:Class" (one instance per episode; `reset(record) -> messages`, `step(messages,
    reply) -> (observation messages, reward, done)`). The environment's rewards replace
    the reward functions; prompts are its reset conversations, rendered by
    data.chat_template. None: single-turn."""
    env_max_turns: int = 4
    """Replies per episode at most; an episode still going after them scores 0."""
    env_max_tokens: int = 96
    """Tokens after the prompt per episode at most (replies and observations); an episode
    past it scores 0. Prompts may take data.seq_len minus this."""

    rollout_engine: Literal["native", "vllm"] = "native"
    """What samples the rollouts: our generation engine in the training process (native), or
    vLLM in its own process and Python environment (`rl/vllm_rollout.py`: the policy's
    weights reach it every step, its prefix cache reset; its log-probs are the sampler's).
    vllm: colocated placement, no tensor or context parallel; environments and async
    rollouts too (a sync waits for the generate call in flight: no partial rollouts)."""
    vllm_python: Path | None = None
    """With rollout_engine vllm: the Python of an environment with vLLM (None:
    MINDSPEED_VLLM_PYTHON, else one created once with uv under ~/.cache/mindspeed/vllm)."""

    section = "grpo"
    """The section's name in configs and messages (a class attribute, not a field)."""

    def __post_init__(self):
        check_grpo_section(self)

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high): clip_low and clip_high, the policy loss's where unset."""
        loss = POLICY_LOSSES[self.loss]
        low = loss.clip_low if self.clip_low is None else self.clip_low
        return low, loss.clip_high if self.clip_high is None else self.clip_high

    def aggregation(self) -> str:
        """loss_agg, the policy loss's where unset."""
        return POLICY_LOSSES[self.loss].loss_agg if self.loss_agg is None else self.loss_agg


@dataclass(kw_only=True)
class GRPOTrainSection(TrainSection):
    """Pretraining's train section with GRPO's demo defaults; batches count samples."""

    steps: int = 300
    """Optimizer steps (one rollout each)."""
    micro_batch: int = 64
    """Samples (prompt + completion) per forward/backward on each data-parallel rank."""
    global_batch: int = 128
    """Samples per step over all ranks: train.global_batch / grpo.n prompts."""
    eval_interval: int = 0
    """Unused: GRPO has no validation loss (the greedy reward is printed at the ends)."""


@dataclass(kw_only=True)
class GRPOLoggingSection(LoggingSection):
    run_dir: Path = Path("runs/grpo")
    """Where config.yaml, metrics.jsonl, tb/, checkpoints/ and loss_curve.png go."""
    log_interval: int = 5


@dataclass(kw_only=True)
class GRPOOptimSection(OptimConfig):
    """AdamW with GRPO's demo defaults: a constant LR, no weight decay."""

    lr: float = 1e-3
    warmup_steps: int = 0
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "constant"
    weight_decay: float = 0.0


@dataclass(kw_only=True)
class PPOSection(GRPOSection):
    """GRPOSection's rollout, reward and policy-loss fields with PPO's defaults, plus GAE's."""

    section = "ppo"

    n: int = 4
    """Samples per prompt (1 is classic PPO; more share a prompt's prefill)."""
    advantage: str = "gae"
    """gae: GAE over the critic's values; another registered estimator (grpo, rloo, ...)
    gives the policy its advantages from the outcome rewards (the reward's KL term then
    reaches only the critic's returns) while the critic still trains on GAE's returns."""
    gamma: float = 1.0
    """GAE's discount per token (verl and TRL: 1.0)."""
    lam: float = 0.95
    """GAE's lambda (TRL: 0.95; verl: 1.0)."""
    kl_coef: float = 0.05
    """KL penalty against the starting model (0: no reference is built)."""
    kl_in_reward: bool = True
    """Subtract kl_coef x KL per token from the reward (TRL's PPO and verl's
    `use_kl_in_reward`); false: add it to the policy loss, as GRPO does."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """k1 = logp - ref_logp per token in the reward (TRL's PPO)."""
    recompute_old_logps: bool = True
    """PPO scores the KL of the reward with the old log-probs before the step, so they are
    recomputed (false is refused with ppo.kl_in_reward and a ppo.kl_coef)."""
    whiten_advantages: bool = True
    """GAE advantages whitened over every response token of the step (all ranks)."""
    warmup_steps: int = 150

    def __post_init__(self):
        super().__post_init__()
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"ppo.gamma={self.gamma} and ppo.lam={self.lam} must be in [0, 1]")
        if self.async_rollout != "off":
            raise ConfigError("ppo.async_rollout: one-step and bounded off-policy rollouts are "
                              "for `mindspeed grpo` and `mindspeed dapo`")  # fmt: skip
        if self.env is not None:
            raise ConfigError("ppo.env: multi-turn episodes are for `mindspeed grpo` and "
                              "`mindspeed dapo` (the critic does not mask tool tokens yet)")  # fmt: skip
        if self.kl_in_reward and self.kl_coef and not self.recompute_old_logps:
            raise ConfigError("ppo.recompute_old_logps=false: the KL in the reward "
                              "(ppo.kl_in_reward, ppo.kl_coef) needs the old log-probs first")  # fmt: skip


@dataclass(kw_only=True)
class CriticSection(GRPOOptimSection):
    """The critic (value model): the policy's decoder with a one-output head, its own AdamW."""

    config_key = "critic"
    lr: float = 1e-3
    value_clip: float = 0.2
    """Clip of the new values around the rollout's: 0.5 x max((V - R)^2, (clip(V, V_old -
    c, V_old + c) - R)^2) per response token (TRL's cliprange_value 0.2; verl 0.5)."""
    init_from: Path | None = None
    """Start from a trained reward model, value head included: the Hugging Face
    *ForSequenceClassification folder `mindspeed rm --rm.export_hf` writes; None: the policy's
    starting weights with a new value head."""

    def __post_init__(self):
        super().__post_init__()
        if not self.value_clip > 0:
            raise ConfigError(f"critic.value_clip={self.value_clip} must be > 0")


@dataclass(kw_only=True)
class PPOLoggingSection(LoggingSection):
    run_dir: Path = Path("runs/ppo")
    """Where config.yaml, metrics.jsonl, tb/, checkpoints/ and loss_curve.png go."""
    log_interval: int = 5


@dataclass(kw_only=True)
class RLConfig:
    """The sections every online-RL command shares; `rl` is the algorithm's own section."""

    model: ModelSection = field(default_factory=ModelSection)
    data: PromptDataSection = field(default_factory=PromptDataSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: GRPOOptimSection = field(default_factory=GRPOOptimSection)
    train: GRPOTrainSection = field(default_factory=GRPOTrainSection)
    """train.global_batch and micro_batch count samples (prompts x n)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingSection = field(default_factory=GRPOLoggingSection)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapters on the policy (`mindspeed_llm.peft`, as `mindspeed sft --lora.rank`): only
    they train and are checkpointed; the reference is the policy with its adapters off;
    the rollout gets the base once and the adapters every step (vLLM: merged weights).
    PPO's critic trains whole. `lora.rank 0` (the default): the whole policy trains."""

    @property
    def rl(self) -> GRPOSection:
        raise NotImplementedError

    def check_env_lengths(self) -> None:
        """Raise ConfigError when an environment run's episode budget leaves no room for a
        prompt (checked when the run starts: the calculator demo sets its own lengths)."""
        rl = self.rl
        if rl.env is not None and rl.env_max_tokens >= self.data.seq_len:
            raise ConfigError(
                f"{rl.section}.env_max_tokens={rl.env_max_tokens} leaves no room for a prompt "
                f"in data.seq_len={self.data.seq_len}"
            )

    def __post_init__(self):
        rl, name = self.rl, self.rl.section
        if self.parallel.pp > 1 or self.parallel.cp > 1:
            raise ConfigError(
                f"parallel.pp={self.parallel.pp}, parallel.cp={self.parallel.cp}: "
                f"mindspeed {name} rolls out whole sequences on whole models; use tp and dp"
            )
        samples = self.train.global_batch
        if samples % rl.n:
            raise ConfigError(
                f"train.global_batch={samples} samples is not a whole number of groups of "
                f"{name}.n={rl.n}"
            )
        if rl.max_new_tokens >= self.data.seq_len:
            raise ConfigError(
                f"{name}.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt "
                f"in data.seq_len={self.data.seq_len}"
            )
        if self.optim.warmup_steps > self.train.steps:
            raise ConfigError(
                f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
            )
        self._check_token_budget()
        if self.lora.quantize != "none":
            raise ConfigError(
                f"lora.quantize={self.lora.quantize}: mindspeed {name} trains plain LoRA "
                "adapters only yet (the rollout's copy of the policy needs the base unquantised)"
            )

    def _check_token_budget(self) -> None:
        """A micro-batch holds a sample whole (with shared prompts: a prompt's group)."""
        rl, budget = self.rl, self.train.micro_batch_tokens
        if budget is None:
            return
        longest, what = self.data.seq_len, f"data.seq_len={self.data.seq_len}"
        if rl.shared_prompts != "off":
            longest += (rl.n - 1) * rl.max_new_tokens
            what = (f"a prompt's group with {rl.section}.shared_prompts={rl.shared_prompts} "
                    f"(data.seq_len + ({rl.section}.n - 1) x max_new_tokens = {longest})")  # fmt: skip
        if budget < longest:
            raise ConfigError(f"train.micro_batch_tokens={budget} is below {what}")


@dataclass(kw_only=True)
class GRPOConfig(RLConfig):
    grpo: GRPOSection = field(default_factory=GRPOSection)

    @property
    def rl(self) -> GRPOSection:
        return self.grpo


@dataclass(kw_only=True)
class DAPOLoggingSection(LoggingSection):
    run_dir: Path = Path("runs/dapo")
    """Where config.yaml, metrics.jsonl, tb/, checkpoints/ and loss_curve.png go."""
    log_interval: int = 5


def _dapo_section() -> GRPOSection:
    return GRPOSection(clip_high=0.28, dynamic_sampling=True, loss_agg="token-mean", kl_coef=0.0)


@dataclass(kw_only=True)
class DAPOConfig(GRPOConfig):
    """`mindspeed dapo`: GRPO's sections with DAPO's defaults (verl's recipe): clip-higher
    (clip_high 0.28), dynamic sampling (zero-variance groups dropped), token-mean loss, no KL.
    Its soft overlong penalty is `--grpo.overlong_buffer N` (off by default: the demo's
    answers are a few tokens long)."""

    logging: LoggingSection = field(default_factory=DAPOLoggingSection)
    grpo: GRPOSection = field(default_factory=_dapo_section)
    """The method (DAPO's defaults; the section keeps its `mindspeed grpo` name)."""
    train: GRPOTrainSection = field(default_factory=lambda: GRPOTrainSection(steps=450))
    """450 demo steps: without a KL anchor and with dynamic sampling DAPO's demo rises more
    slowly than GRPO's (with the demo's LR schedule, one thread: held-out greedy 0.92 at 300
    steps, 0.98 at 450)."""


@dataclass(kw_only=True)
class PPOConfig(RLConfig):
    logging: LoggingSection = field(default_factory=PPOLoggingSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    critic: CriticSection = field(default_factory=CriticSection)

    @property
    def rl(self) -> PPOSection:
        return self.ppo
