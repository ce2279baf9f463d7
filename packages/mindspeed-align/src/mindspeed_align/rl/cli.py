"""`mindspeed grpo` and `mindspeed ppo`: online RL with rule rewards (no arguments: the
embedded demo).

The demo pretrains the debug Llama briefly on the pretrain demo's stories (so it knows
the format "... 3 plus 2 is 5", not yet the sums), then GRPO (or PPO with a critic)
rewards the right sum after "x plus y is" and prints the greedy reward on held-out prompts
before and after. Several processes: `torchrun --standalone --nproc-per-node 2 -m
mindspeed_align.rl.cli [ppo] --parallel.dp_shard 2`.
"""

from __future__ import annotations

from mindspeed_core.lifeline import arm_if_spawned_helper

arm_if_spawned_helper(__name__)  # a reward worker re-importing this module: armed first

# ruff: noqa: E402 (the imports below pull in torch: they come after the line above)
import dataclasses
import logging
import sys
from pathlib import Path

from mindspeed_align.rl.config import DAPOConfig, GRPOConfig, PPOConfig, RLConfig
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_llm.peft.targets import HF_NAMES

logger = logging.getLogger("mindspeed.grpo")

__all__ = ["command", "dapo_command", "grpo", "main", "ppo", "ppo_command", "ppo_main"]


def _is_demo(cfg: GRPOConfig) -> bool:
    return cfg.data.prompts is None and cfg.rl.init_from is None and cfg.model.hf_path is None


CALCULATOR_DEMO = {"data.seq_len": 128, "data.eval_prompts": 128, "grpo.max_new_tokens": 40,
                   "grpo.warmup_steps": 1500, "train.steps": 40, "optim.warmup_steps": 3,
                   "optim.decay_style": "cosine", "logging.run_dir": Path("runs/grpo-calculator")}  # fmt: skip
"""The calculator demo's values of the fields left at their (story demo's) defaults. 40
steps with 3 warm-up steps and a cosine decay: at a constant 1e-3 for 30 steps the sampled
reward still swung (0.86 at step 25, 0.72 at 30) and the held-out greedy reward ended at
0.73-0.81 over seeds; settled, it ends at 0.90-0.94 (seeds 1234, 1, 2 and one-step
off-policy, 2-core Intel Xeon, 2026-11-28). Its own run directory: in `runs/grpo` (and
`runs/grpo-warmup`) `mindspeed grpo` afterwards found the calculator's checkpoints and refused
them."""

ARITHMETIC_DEMO = {"optim.warmup_steps": 20, "optim.decay_style": "cosine"}
"""The arithmetic demo's (`mindspeed grpo` / `dapo`) learning-rate schedule, for the fields
left at their defaults: AdamW's first steps at the full 1e-3 undo what the warm-up taught
(one such step took a well warmed-up policy's held-out greedy reward from 1.00 to 0.53),
and a constant rate to the last step leaves the policy oscillating, so the final reward
was a draw that depended on the CPU's rounding (greedy 0.70 on an Intel Xeon, 0.91 on an
AMD EPYC). 20 warm-up steps and a cosine decay (to 0.1x) end it settled."""


LORA_DEMO = {"optim.lr": 3e-3, "lora.alpha": 4.0,
             "lora.targets": [*HF_NAMES.values(), "lm_head"]}  # fmt: skip
"""The demos' LoRA (`mindspeed grpo --lora.rank 2`), for the fields left at their defaults:
every linear layer and the output layer adapted, alpha 4 (scaling 2), 3e-3. Measured on the
arithmetic demo (300 steps, 2-core Intel Xeon, 2026-11-28): the warmed-up model never
answers 7, 8, 9 or 10 (greedy 0.69), and its output layer is what has to move: full
fine-tuning went 0.69 -> 0.91 greedy, with the output layer frozen 0.70 (embeddings frozen:
0.91; only embeddings and head trained: 0.83), as LoRA on the decoder's layers alone did
(rank 16: 0.69-0.70 from 1e-3 to 5e-3; 1e-2 and above fell apart). With lm_head, rank 2
ends at 0.86 / 0.81 / 0.78 greedy from 0.69 / 0.63 / 0.63 (seeds 1234 / 1 / 2; sampled
0.31 -> 0.82 at 1234), sending 20,992 bytes of adapters a step against 579,328 for the
whole model (3.6%). Within 5% only rank 2 adapts every layer and the head (rank 3: 5.3%);
the head alone (rank 8, 3.2%) reached 0.83 at 1e-2 but 0.70 at 5e-3 and 0.69 at 2e-2, and
q_proj, v_proj and the head (rank 4, 1e-2) 0.84 at seed 1234 but 0.70 at seeds 1 and 2:
those runs' sampling entropy collapsed early onto wrong sums."""


def _demo_defaults(cfg: GRPOConfig, command: str) -> None:
    """The embedded demos' settings (`--env calculator`: its lengths and steps; the
    arithmetic demo of `grpo` and `dapo`: its LR schedule; with LoRA: its targets and LR)
    for every field the user did not set (its value is still the class default), said in
    the log."""
    if not _is_demo(cfg):
        return
    if cfg.rl.env == "calculator":
        name, values = "calculator demo", CALCULATOR_DEMO
    elif cfg.rl.env is None and command == "grpo":
        name, values = "demo", {**ARITHMETIC_DEMO, "optim.warmup_steps": min(
            ARITHMETIC_DEMO["optim.warmup_steps"], cfg.train.steps)}  # fmt: skip
    else:
        name, values = "demo", {}
    if cfg.lora.enabled:
        values = {**values, **LORA_DEMO}
    if cfg.rl.rollout_engine == "vllm":  # vLLM's CPU attention: heads of >= 32 channels
        run_dir = values.get("logging.run_dir", Path(f"runs/{command}"))  # its own: another model
        values = {**values, "model.flavor": "debug-h32",
                  "logging.run_dir": run_dir.with_name(run_dir.name + "-vllm")}  # fmt: skip
    fresh, changed = type(cfg)(), []
    for key, value in values.items():
        section, field_name = key.split(".")
        section = cfg.rl.section if section == "grpo" else section
        if key == "model.flavor" and cfg.model.family != "llama":
            continue
        here, default = getattr(cfg, section), getattr(getattr(fresh, section), field_name)
        if getattr(here, field_name) == default:
            setattr(here, field_name, list(value) if isinstance(value, list) else value)
            changed.append(f"{section}.{field_name}={value}")
    if changed:
        logger.info("%s: %s", name, ", ".join(changed))


def _warmup(cfg: GRPOConfig) -> Path | None:
    """The demo's starting model: a short pretraining on the demo corpus (resumed, so a
    second run skips it), or for the calculator SFT on its demonstrations; its checkpoints
    folder."""
    from mindspeed_llm.pretrain import pretrain
    from mindspeed_llm.train.config import LoggingSection, PretrainConfig, TrainSection

    run_dir = cfg.logging.run_dir.with_name(cfg.logging.run_dir.name + "-warmup")
    if cfg.rl.warmup_steps == 0:
        return None
    from mindspeed_core.optim import OptimConfig

    if cfg.rl.env == "calculator":
        return _calculator_warmup(cfg, run_dir)

    pre = PretrainConfig(
        model=cfg.model,
        optim=OptimConfig(warmup_steps=min(20, cfg.rl.warmup_steps)),
        parallel=cfg.parallel,
        train=TrainSection(steps=cfg.rl.warmup_steps, device=cfg.train.device,
                           eval_interval=0, seed=cfg.train.seed),
        logging=LoggingSection(run_dir=run_dir, log_interval=20, tensorboard=False,
                               progress=cfg.logging.progress),
    )  # fmt: skip
    logger.info("demo: pretraining the starting model for %d steps (%s)", pre.train.steps, run_dir)
    pretrain(pre)
    return run_dir / "checkpoints"


def _calculator_warmup(cfg: GRPOConfig, run_dir: Path) -> Path:
    """SFT of the demo's model on the calculator demonstrations (resumed when done)."""
    from mindspeed_align.rl.calculator import ensure_calculator_demo
    from mindspeed_core.checkpoint import CheckpointConfig
    from mindspeed_core.optim import OptimConfig
    from mindspeed_llm.sft import sft
    from mindspeed_llm.train.config import LoggingSection, TrainSection
    from mindspeed_llm.train.sft_config import SFTConfig, SFTDataSection

    demo = _on_rank0_first(ensure_calculator_demo)
    pre = SFTConfig(
        model=cfg.model,
        data=SFTDataSection(paths=[str(demo.train)], handler="messages", tokenizer=demo.tokenizer,
                            chat_template=str(demo.template), seq_len=128),
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        parallel=cfg.parallel,
        train=TrainSection(steps=cfg.rl.warmup_steps, micro_batch=16, global_batch=16,
                           device=cfg.train.device, eval_interval=0, seed=cfg.train.seed),
        checkpoint=CheckpointConfig(interval=cfg.rl.warmup_steps),
        logging=LoggingSection(run_dir=run_dir, log_interval=100, tensorboard=False,
                               progress=cfg.logging.progress),
    )  # fmt: skip
    logger.info("calculator demo: SFT of the starting model on tool-use demonstrations for %d "
                "steps (%s)", pre.train.steps, run_dir)  # fmt: skip
    sft(pre)
    return run_dir / "checkpoints"


def _on_rank0_first(build):
    """`build()` on rank 0, then on the others (a cached build: they find it made)."""
    import torch.distributed as dist

    from mindspeed_core.distributed import is_rank0

    if is_rank0():
        build()
    if dist.is_initialized():
        dist.barrier()
    return build()


def _env_records(cfg: GRPOConfig):
    """(training records, held-out records) of an environment run."""
    from mindspeed_align.rl.data import read_prompts

    if cfg.data.prompts is None:
        if cfg.rl.env != "calculator":
            raise ConfigError(f"{cfg.rl.section}.env={cfg.rl.env!r} needs data.prompts")
        from mindspeed_align.rl.calculator import records as calculator_records

        train = calculator_records(4096, seed=cfg.train.seed)
        return train, calculator_records(cfg.data.eval_prompts, seed=cfg.train.seed + 1)
    return _held_out(cfg, read_prompts(cfg.data.prompts, any_record=True))


def _held_out(cfg: GRPOConfig, records: list):
    k = cfg.data.eval_prompts
    if k >= len(records):
        raise ConfigError(
            f"data.eval_prompts={k} leaves none of the {len(records)} prompts of "
            f"{cfg.data.prompts} to train on"
        )
    return (records[:-k], records[-k:]) if k else (records, [])


def _env_prompts(cfg: GRPOConfig, make_env, template, records, source: str) -> None:
    """Each record's "prompt": its environment's reset conversation, rendered (with the
    environment's `tools`, when it names them)."""
    from mindspeed_align.rl.data import render_prompts

    for i, record in enumerate(records):
        try:
            messages = make_env().reset(record)
        except Exception as err:  # the user's environment refusing its record
            raise DataError(f"{source}: record {i}: {cfg.rl.section}.env reset failed: {err!r}") from None
        record["messages"] = messages
    render_prompts(records, template, source=source, tools=getattr(make_env, "tools", None))


def _task(cfg: GRPOConfig, init_from: Path | None):
    """(tokenizer, its path, training records, held-out records, environment class,
    chat template); the last two are None for single-turn runs."""
    from mindspeed_align.rl.data import demo_records, read_prompts
    from mindspeed_llm.tokenizer import load_tokenizer

    if cfg.rl.env is not None:
        return _env_task(cfg, init_from)
    if cfg.data.prompts is None:
        records = demo_records(4096, seed=cfg.train.seed)
        held_out = demo_records(cfg.data.eval_prompts, seed=cfg.train.seed + 1)
    else:
        from mindspeed_align.rl.rewards import required_columns

        records, held_out = _held_out(cfg, read_prompts(cfg.data.prompts, required_columns(cfg.rl.rewards, cfg.rl.section)))
    path = _tokenizer_path(cfg, init_from)
    if cfg.data.chat_template is not None or any("messages" in r for r in records + held_out):
        from mindspeed_align.rl.data import render_prompts
        from mindspeed_llm.data.sft_templates import resolve_template

        template = resolve_template(cfg.data.chat_template, path)
        source = str(cfg.data.prompts or "the demo prompts")
        render_prompts(records, template, source=source)
        render_prompts(held_out, template, source=f"{source} (held out)")
        logger.info("prompts rendered by the chat template %s", template.origin)
    return load_tokenizer(path), path, records, held_out, None, None


def _env_task(cfg: GRPOConfig, init_from: Path | None):
    """`_task` of an environment run: the records' prompts are the environment's reset
    conversations rendered by the chat template (the calculator demo's own template and
    tokenizer when it is the demo)."""
    from mindspeed_align.rl.env import load_environment
    from mindspeed_llm.data.sft_templates import resolve_template
    from mindspeed_llm.tokenizer import load_tokenizer

    make_env = load_environment(cfg.rl.env, section=cfg.rl.section)
    records, held_out = _env_records(cfg)
    if cfg.data.prompts is None:  # the calculator demo
        from mindspeed_align.rl.calculator import ensure_calculator_demo

        demo = _on_rank0_first(ensure_calculator_demo)
        path = cfg.data.tokenizer or demo.tokenizer
        template = resolve_template(cfg.data.chat_template or str(demo.template), path)
    else:
        path = _tokenizer_path(cfg, init_from)
        template = resolve_template(cfg.data.chat_template, path)
    source = str(cfg.data.prompts or "the calculator demo")
    _env_prompts(cfg, make_env, template, records, source)
    _env_prompts(cfg, make_env, template, held_out, f"{source} (held out)")
    logger.info("episodes in %s; prompts rendered by the chat template %s", cfg.rl.env, template.origin)
    return load_tokenizer(path), path, records, held_out, make_env, template


def _tokenizer_path(cfg: GRPOConfig, init_from: Path | None):
    path = cfg.data.tokenizer or cfg.model.hf_path
    if path is None and init_from is not None:
        from mindspeed_llm.loading import resolve_model_source

        path = resolve_model_source(init_from).tokenizer
    if path is None:
        from mindspeed_llm.demo import ensure_demo_data

        if cfg.data.prompts is not None:
            raise ConfigError(
                f"data.tokenizer is needed with data.prompts (or {cfg.rl.section}.init_from)"
            )
        path = ensure_demo_data().tokenizer
    return path


def grpo(cfg: GRPOConfig) -> dict[str, float]:
    """Run GRPO in this process (one rank of a torchrun job, or alone)."""
    from mindspeed_align.rl.grpo import GRPOMethod

    return _run(cfg, GRPOMethod, "grpo")


def ppo(cfg: PPOConfig) -> dict[str, float]:
    """Run PPO (with a critic) in this process (one rank of a torchrun job, or alone)."""
    from mindspeed_align.rl.ppo import PPOMethod

    return _run(cfg, PPOMethod, "ppo")


def _run(cfg: RLConfig, method, command: str) -> dict[str, float]:
    from mindspeed_align.rl.data import PromptSource
    from mindspeed_llm.peft import lora_trainer_options
    from mindspeed_llm.train.trainer import Trainer

    rewards = roles = trainer = None
    _demo_defaults(cfg, command)
    cfg.check_env_lengths()
    if cfg.rl.trainer_actors:  # the policy trains on Ray actors; this process waits for them
        from mindspeed_align.rl.ray_groups import run_on_trainer_actors

        summary = run_on_trainer_actors(cfg, ppo if command == "ppo" else grpo)
        logger.info("trained on %d Ray actors to step %d: held-out reward %s at the start -> %s; "
                    "run directory %s", cfg.rl.trainer_actors, summary["steps"],
                    _rounded(summary["reward_before"]), _rounded(summary["reward_after"]),
                    cfg.logging.run_dir)  # fmt: skip
        return summary
    with process_group(cfg.train.device) as info:
        try:
            init_from = _warmup(cfg) if _is_demo(cfg) else cfg.rl.init_from
            if cfg.lora.enabled and init_from is not None:
                # adapter-only checkpoints: config.yaml names the base they go on
                cfg.rl.init_from = init_from
            tokenizer, tokenizer_path, records, held_out, env, template = _task(cfg, init_from)
            g = cfg.rl
            max_prompt = cfg.data.seq_len - (g.max_new_tokens if env is None else g.env_max_tokens)
            if g.placement == "ray":
                from mindspeed_align.rl.placement import RayRoles

                roles = RayRoles(g.section, info.world_size, resources=g.ray_resources)
                rewards = None if env else roles.rewards(g, tokenizer_path)
            elif env is None:  # an environment scores its own episodes
                from mindspeed_align.rl.reward_model import section_rewards

                rewards = section_rewards(g, tokenizer, info.device)

            def data(cfg_, model_cfg):
                return PromptSource(records, tokenizer, max_prompt_len=max_prompt,
                                    prompts_per_step=cfg.train.global_batch // g.n, seed=cfg.train.seed,
                                    source=str(cfg.data.prompts or "the demo prompts"))  # fmt: skip

            objective = method(cfg, tokenizer, rewards, init_from, roles=roles, env=env,
                               template=template)  # fmt: skip
            lora = lora_trainer_options(cfg.lora, precision=cfg.train.precision,
                                        device_type=info.device.type)  # fmt: skip
            trainer = Trainer(cfg, info, data=data, objective=objective, command=command,
                              init_from=init_from, init_from_key=f"{g.section}.init_from", **lora)  # fmt: skip
            step = trainer.step
            if env is not None:
                return _run_episodes(cfg, trainer, held_out, tokenizer)
            before = _evaluate(step, held_out, tokenizer, rewards, cfg)
            summary = trainer.run()
            after = _evaluate(step, held_out, tokenizer, rewards, cfg)
            summary.update(reward_before=before, reward_after=after)
            logger.info(
                "reward on %d held-out prompts (greedy; %d samples at temperature %g): "
                "%.3f; %.3f at the start -> %.3f; %.3f after step %d; run directory %s",
                len(held_out), g.n, g.temperature, *before, *after, summary["steps"],
                cfg.logging.run_dir,
            )  # fmt: skip
            return summary
        finally:
            if rewards is not None:
                rewards.close()
            if roles is not None:
                roles.close()
            if trainer is not None and hasattr(trainer.step.rollout, "close"):
                trainer.step.rollout.close()  # vLLM's engine


def _rounded(value) -> str:
    """A reward (or a (greedy, sampled) pair of them) for the log."""
    return ", ".join(f"{v:.3f}" for v in value) if isinstance(value, (tuple, list)) else f"{value:.3f}"


def _run_episodes(cfg: GRPOConfig, trainer, held_out, tokenizer) -> dict[str, float]:
    """Train in the environment, with the held-out success (greedy) and tool calls per
    episode printed before and after."""
    from mindspeed_align.rl.grpo import evaluate_episodes

    step, g = trainer.step, cfg.rl

    def evaluate() -> tuple[float, float]:
        step.settle()
        step.rollout.sync_weights()
        return evaluate_episodes(step.rollout, step.env, held_out, tokenizer, step.template, g)

    before = evaluate()
    summary = trainer.run()
    after = evaluate()
    summary.update(reward_before=before[0], reward_after=after[0], tool_calls_before=before[1],
                   tool_calls_after=after[1])  # fmt: skip
    logger.info(
        "%s: held-out reward on %d episodes (greedy) %.3f at the start -> %.3f after step %d; "
        "tool calls per episode %.2f -> %.2f; run directory %s", g.env, len(held_out), before[0],
        after[0], summary["steps"], before[1], after[1], cfg.logging.run_dir,
    )  # fmt: skip
    return summary


def _evaluate(step, held_out, tokenizer, rewards, cfg: GRPOConfig) -> tuple[float, float]:
    """(greedy, sampled) mean reward of the current policy on the held-out prompts."""
    from mindspeed_align.rl.grpo import evaluate_reward

    g = cfg.rl
    step.settle()
    step.rollout.sync_weights()
    greedy = evaluate_reward(step.rollout, held_out, tokenizer, rewards, g.max_new_tokens)
    sampled = evaluate_reward(step.rollout, held_out, tokenizer, rewards, g.max_new_tokens,
                              temperature=g.temperature, n=g.n, seed=cfg.train.seed)  # fmt: skip
    return greedy, sampled


def _env_alias(command):
    """The command with `--env X` read as `--grpo.env X` (the issue's and verl users' short
    spelling of the environment)."""
    inner = command.run

    def run(argv: list[str]) -> int | None:
        return inner(["--grpo.env" if a == "--env" else
                      "--grpo.env=" + a[6:] if a.startswith("--env=") else a for a in argv])  # fmt: skip

    return dataclasses.replace(command, run=run)


command = _env_alias(config_command(
    "grpo",
    GRPOConfig,
    grpo,
    help="GRPO with rule rewards or an environment (no arguments: the embedded demo)",
    demo="GRPO on the demo's arithmetic (CPU, a few minutes); with --env calculator, "
    "multi-turn tool use on two-digit products.",
))
main = command.run

dapo_command = _env_alias(config_command(
    "dapo",
    DAPOConfig,
    grpo,
    help="DAPO: GRPO with clip-higher, dynamic sampling and token-mean loss (no arguments: the demo)",
    demo="DAPO on the demo's arithmetic (CPU, a few minutes).",
))
ppo_command = config_command(
    "ppo",
    PPOConfig,
    ppo,
    help="PPO with a critic and rule rewards (no arguments: the embedded demo)",
    demo="PPO (GAE with a critic) on the demo's arithmetic (CPU, a few minutes).",
)
ppo_main = ppo_command.run


if __name__ == "__main__":
    args = sys.argv[1:]
    run = main
    if args[:1] in (["ppo"], ["dapo"]):
        run, args = {"ppo": ppo_main, "dapo": dapo_command.run}[args[0]], args[1:]
    sys.exit(guarded(run, [a for a in args if a != "--debug"], debug=debug_enabled(args)))
