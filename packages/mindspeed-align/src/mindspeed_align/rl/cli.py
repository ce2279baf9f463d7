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
import logging
import sys
from pathlib import Path

from mindspeed_align.rl.config import DAPOConfig, GRPOConfig, PPOConfig, RLConfig
from mindspeed_core.cli import config_command, debug_enabled, guarded
from mindspeed_core.distributed import process_group
from mindspeed_core.errors import ConfigError

logger = logging.getLogger("mindspeed.grpo")

__all__ = ["command", "dapo_command", "grpo", "main", "ppo", "ppo_command", "ppo_main"]


def _is_demo(cfg: GRPOConfig) -> bool:
    return cfg.data.prompts is None and cfg.rl.init_from is None and cfg.model.hf_path is None


def _warmup(cfg: GRPOConfig) -> Path | None:
    """The demo's starting model: a short pretraining on the demo corpus (resumed, so a
    second run skips it); its checkpoints folder."""
    from mindspeed_llm.pretrain import pretrain
    from mindspeed_llm.train.config import LoggingSection, PretrainConfig, TrainSection

    run_dir = cfg.logging.run_dir.with_name(cfg.logging.run_dir.name + "-warmup")
    if cfg.rl.warmup_steps == 0:
        return None
    from mindspeed_core.optim import OptimConfig

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


def _task(cfg: GRPOConfig, init_from: Path | None):
    """(tokenizer, its path, training records, held-out records)."""
    from mindspeed_align.rl.data import demo_records, read_prompts
    from mindspeed_llm.tokenizer import load_tokenizer

    if cfg.data.prompts is None:
        records = demo_records(4096, seed=cfg.train.seed)
        held_out = demo_records(cfg.data.eval_prompts, seed=cfg.train.seed + 1)
    else:
        from mindspeed_align.rl.rewards import required_columns

        records = read_prompts(cfg.data.prompts, required_columns(cfg.rl.rewards))
        k = cfg.data.eval_prompts
        if k >= len(records):
            raise ConfigError(
                f"data.eval_prompts={k} leaves none of the {len(records)} prompts of "
                f"{cfg.data.prompts} to train on"
            )
        records, held_out = (records[:-k], records[-k:]) if k else (records, [])
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
    if cfg.data.chat_template is not None or any("messages" in r for r in records + held_out):
        from mindspeed_align.rl.data import render_prompts
        from mindspeed_llm.data.sft_templates import resolve_template

        template = resolve_template(cfg.data.chat_template, path)
        source = str(cfg.data.prompts or "the demo prompts")
        render_prompts(records, template, source=source)
        render_prompts(held_out, template, source=f"{source} (held out)")
        logger.info("prompts rendered by the chat template %s", template.origin)
    return load_tokenizer(path), path, records, held_out


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
    from mindspeed_llm.train.trainer import Trainer

    rewards = roles = None
    with process_group(cfg.train.device) as info:
        try:
            init_from = _warmup(cfg) if _is_demo(cfg) else cfg.rl.init_from
            tokenizer, tokenizer_path, records, held_out = _task(cfg, init_from)
            g = cfg.rl
            if g.placement == "ray":
                from mindspeed_align.rl.placement import RayRoles

                roles = RayRoles(g.section, info.world_size)
                rewards = roles.rewards(g, tokenizer_path)
            else:
                from mindspeed_align.rl.reward_model import section_rewards

                rewards = section_rewards(g, tokenizer, info.device)

            def data(cfg_, model_cfg):
                return PromptSource(records, tokenizer, max_prompt_len=cfg.data.seq_len - g.max_new_tokens,
                                    prompts_per_step=cfg.train.global_batch // g.n, seed=cfg.train.seed,
                                    source=str(cfg.data.prompts or "the demo prompts"))  # fmt: skip

            objective = method(cfg, tokenizer, rewards, init_from, roles=roles)
            trainer = Trainer(cfg, info, data=data, objective=objective, command=command)
            step = trainer.step
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


def _evaluate(step, held_out, tokenizer, rewards, cfg: GRPOConfig) -> tuple[float, float]:
    """(greedy, sampled) mean reward of the current policy on the held-out prompts."""
    from mindspeed_align.rl.grpo import evaluate_reward

    g = cfg.rl
    step.rollout.sync_weights()
    greedy = evaluate_reward(step.rollout, held_out, tokenizer, rewards, g.max_new_tokens)
    sampled = evaluate_reward(step.rollout, held_out, tokenizer, rewards, g.max_new_tokens,
                              temperature=g.temperature, n=g.n, seed=cfg.train.seed)  # fmt: skip
    return greedy, sampled


command = config_command(
    "grpo",
    GRPOConfig,
    grpo,
    help="GRPO with rule rewards (no arguments: the embedded demo)",
    demo="GRPO on the demo's arithmetic (CPU, a few minutes).",
)
main = command.run

dapo_command = config_command(
    "dapo",
    DAPOConfig,
    grpo,
    help="DAPO: GRPO with clip-higher, dynamic sampling and token-mean loss (no arguments: the demo)",
    demo="DAPO on the demo's arithmetic (CPU, a few minutes).",
)
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
