"""MindSpeed-LLM's (Megatron's) common flags and what each is here: one table, rendered as
`docs/migrating-from-mindspeed-llm.md` (`python -m mindspeed_tools.migration > FILE`).

Each row is (their flag, what it is here, a note). What it is here is one of:
- `"CMD:section.field"`: a field of command CMD's config (`mindspeed CMD --section.field V`);
  `tests/test_migration.py` checks every one exists;
- `"mindspeed CMD ..."`: a command (line);
- `"not needed"`: what the flag asked for happens here without it (the note says why);
- `"not built"`: no counterpart yet (the note says what to do instead).
"""

from __future__ import annotations

ROWS: list[tuple[str, str, str]] = [
    # parallel layout
    ("--tensor-model-parallel-size N", "pretrain:parallel.tp", ""),
    ("--pipeline-model-parallel-size N", "pretrain:parallel.pp", ""),
    ("--num-layers-per-virtual-pipeline-stage", "pretrain:parallel.virtual_stages",
     "ours counts stages per rank, not layers per stage; the schedule is `parallel.pp_schedule`"),
    ("--num-layer-list 8,8,8,8", "pretrain:parallel.layers_per_stage", ""),
    ("--schedules-method dualpipev", "pretrain:parallel.pp_schedule", "DualPipeV (also 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble)"),
    ("--sequence-parallel", "pretrain:parallel.sequence_parallel", ""),
    ("--context-parallel-size N", "pretrain:parallel.cp", ""),
    ("--context-parallel-algo megatron_cp_algo|ulysses_cp_algo|hybrid_cp_algo", "pretrain:parallel.cp_mode",
     "ring, ulysses, hybrid"),
    ("--ulysses-degree-in-cp N", "pretrain:parallel.ulysses_degree", ""),
    ("--expert-model-parallel-size N", "pretrain:parallel.ep", "a factor of dp_shard x cp"),
    ("--moe-token-dispatcher-type alltoall|allgather", "pretrain:parallel.ep_dispatcher", ""),
    ("--use-distributed-optimizer", "pretrain:parallel.dp_shard",
     "FSDP2 (ZeRO-3) shards parameters, gradients and optimizer states; -1 (default) takes the ranks left"),
    ("--overlap-grad-reduce / --overlap-param-gather", "not needed", "FSDP2 overlaps its collectives by default"),
    ("--swap-optimizer / --optimizer-offload", "pretrain:parallel.cpu_offload", "needs an accelerator"),
    ("--swap-attention / activation offload", "pretrain:parallel.activation_offload", "needs an accelerator"),
    # recompute and precision
    ("--recompute-granularity full --recompute-method uniform", "pretrain:train.ac", "full"),
    ("--recompute-granularity selective", "pretrain:train.ac", "selective (keeps matmul and attention outputs)"),
    ("--recompute-num-layers N", "not built", "recompute is per block for every block"),
    ("--bf16 / --fp16", "pretrain:train.precision", "bf16, fp16 (dynamic loss scaling) or fp32"),
    ("--fp8-format hybrid", "pretrain:train.fp8", "torchao float8, one dynamic scale per tensor"),
    ("--use-flash-attn", "not needed", "the attention op picks its fastest O(s)-memory kernel per device"),
    ("--use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb", "pretrain:model.ops_impl",
     "fused by default (auto); `reference` for the PyTorch reference"),
    # model
    ("--num-layers / --hidden-size / --num-attention-heads ...", "pretrain:model.hf_config",
     "the architecture comes from a Hugging Face config.json (or model.family + model.flavor)"),
    ("--load (a Hugging Face-converted checkpoint)", "pretrain:model.hf_path",
     "reads the Hugging Face folder itself: no conversion step"),
    ("--make-vocab-size-divisible-by N", "pretrain:model.vocab_divisible_by", ""),
    ("--moe-aux-loss-coeff", "not needed", "read from the model's config.json (router_aux_loss_coef)"),
    # data
    ("--data-path PREFIX", "pretrain:data.paths", "the same .bin/.idx prefixes, optionally weighted"),
    ("--split 969,30,1", "pretrain:data.split", ""),
    ("--seq-length N", "pretrain:data.seq_len", ""),
    ("--tokenizer-model / --tokenizer-name-or-path", "pretrain:data.tokenizer", ""),
    ("--reset-position-ids / --reset-attention-mask", "pretrain:data.reset_position_ids",
     "and data.reset_attention_mask; both on by default"),
    ("--micro-batch-size N", "pretrain:train.micro_batch", ""),
    ("--global-batch-size N", "pretrain:train.global_batch", ""),
    ("--train-iters N", "pretrain:train.steps", ""),
    ("--seed N", "pretrain:train.seed", ""),
    # optimizer
    ("--lr / --min-lr", "pretrain:optim.lr", "min-lr is optim.min_lr_ratio x lr"),
    ("--lr-warmup-iters N", "pretrain:optim.warmup_steps", ""),
    ("--lr-decay-style cosine|linear|constant|WSD", "pretrain:optim.decay_style", ""),
    ("--weight-decay", "pretrain:optim.weight_decay", ""),
    ("--adam-beta1 / --adam-beta2", "pretrain:optim.betas", ""),
    ("--clip-grad", "pretrain:optim.clip_grad", ""),
    # checkpoints and logging
    ("--save DIR / --save-interval N", "pretrain:checkpoint.interval", "checkpoints go to logging.run_dir/checkpoints (or checkpoint.dir)"),
    ("--load DIR (resume)", "pretrain:checkpoint.load",
     "auto resumes from the run directory; a Megatron torch_dist save (fp32) goes on from its "
     "iteration with its Adam state after mindspeed convert --from megatron --with-optimizer"),
    ("--no-load-optim --no-load-rng --finetune", "not needed",
     "starting from Hugging Face weights (model.hf_path) never loads an optimizer"),
    ("--exit-interval N", "pretrain:train.exit_at_step", ""),
    ("--log-interval N", "pretrain:logging.log_interval", ""),
    ("--eval-interval N / --eval-iters N", "pretrain:train.eval_interval", "and train.eval_batches"),
    ("--tensorboard-dir DIR", "pretrain:logging.tensorboard", "written to logging.run_dir/tb"),
    ("--wandb-project", "pretrain:logging.wandb_project",
     "with logging.wandb true (pip install 'mindspeed-core[wandb]'); logging.wandb_mode offline (default) or online"),
    ("--profile --profile-step-start/end", "pretrain:profile.steps", "START:END; `mindspeed profile RUN_DIR` reads it"),
    # fine-tuning and alignment
    ("--stage sft / --finetune --is-instruction-dataset", "mindspeed sft", ""),
    ("--prompt-type qwen|llama3|chatml|...", "sft:data.chat_template", "the same template names"),
    ("--handler-name (SFT data)", "sft:data.handler", "auto by default: told from the records' keys"),
    ("--pack / --neat-pack", "sft:data.mode", "pack (one document per sample in a row) or pad"),
    ("--variable-seq-lengths / --no-pad-to-seq-lengths", "sft:data.mode", "pad"),
    ("--lora-r / --lora-alpha / --lora-target-modules", "sft:lora.rank", "and lora.alpha, lora.targets"),
    ("--qlora / --qlora-nf4", "sft:lora.quantize", "nf4"),
    ("--stage dpo / --is-pairwise-dataset", "mindspeed dpo", "pairs from json/jsonl/parquet or their pairwise prefixes"),
    ("--dpo-beta / --dpo-loss-type", "dpo:dpo.beta", "and dpo.loss (sigmoid, hinge, ipo, robust, simpo, orpo)"),
    ("--ref-model / reference log-probs", "dpo:dpo.ref", "model, precompute or none"),
    ("--stage simpo", "mindspeed simpo", ""),
    ("--stage orm", "mindspeed rm", ""),
    ("--stage prm", "mindspeed prm", ""),
    ("--stage trl_ppo / ray_ppo", "mindspeed ppo", "colocated; reference and rewards on Ray with grpo.placement"),
    ("--stage ray_grpo", "mindspeed grpo", ""),
    # tools
    ("preprocess_data.py", "mindspeed preprocess", "the same flags (--input, --handler-name, --output-prefix, ...)"),
    ("convert_ckpt.py --load-model-type hf --save-model-type mg", "mindspeed convert --to mindspeed",
     "or no conversion: model.hf_path; --to megatron --tp --pp writes Megatron's mp_rank_* layout"),
    ("convert_ckpt.py --load-model-type mg --save-model-type hf", "mindspeed convert --to hf",
     "reads the mp_rank_* (or torch_dist) folder itself: --from megatron, picked automatically"),
    ("inference.py --task chat", "mindspeed chat", ""),
    ("inference.py --task greedy|do_sample|beam_search", "mindspeed generate", "--num-beams for beam search"),
    ("evaluation.py --task mmlu ceval boolq bbh agieval human_eval", "mindspeed eval", "the same local data layouts"),
]


def _config_class(command: str):
    from mindspeed_core.cli import discover_commands

    return discover_commands()[command].load().config_cls


def field_exists(target: str) -> bool:
    """Whether `CMD:section.field` names a field of command CMD's config."""
    import dataclasses

    command, _, dotted = target.partition(":")
    obj = _config_class(command)()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def render() -> str:
    """The markdown of `docs/migrating-from-mindspeed-llm.md`."""
    lines = [
        "# Migrating from MindSpeed-LLM",
        "",
        "MindSpeed-LLM's (and Megatron-LM's) common flags, and what each is here. Our commands take",
        "dotted config fields (`mindspeed pretrain --parallel.tp 2`) or a YAML file with the same",
        "sections (`--config FILE`; `mindspeed recipes` ships one per published model). Generated",
        "from `mindspeed_tools.migration.ROWS` (`python -m mindspeed_tools.migration`); a test checks",
        "that every field named exists. Their preprocessed `.bin`/`.idx` pretraining data, SFT and",
        "pairwise (DPO) prefixes load as they are (`data.paths`); their Megatron-Core checkpoints",
        "(legacy `mp_rank_*` or `torch_dist`; dense, Mixtral- and Qwen3-MoE-style, virtual pipeline)",
        "convert with `mindspeed convert --from megatron`; their chat templates keep their names.",
        "",
        "| MindSpeed-LLM | here | note |",
        "|---|---|---|",
    ]
    for flag, target, note in ROWS:
        if target.startswith(("not needed", "not built", "mindspeed ")):
            here = f"`{target}`" if target.startswith("mindspeed ") else f"*{target}*"
        else:
            command, _, dotted = target.partition(":")
            here = f"`mindspeed {command} --{dotted}`"
        lines.append(f"| `{flag}` | {here} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
