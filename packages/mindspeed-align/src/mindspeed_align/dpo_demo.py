"""The embedded DPO demo: prefer the right answer of the SFT demo's counting questions.

The pairs reuse the SFT demo (`mindspeed_llm.sft_demo`): its questions, tokenizer and chat
template; chosen is the right number word, rejected a wrong one. They are generated once and
cached next to the SFT demo. The demo starts from the debug Llama briefly fine-tuned on the SFT
demo task (`warm_start`), and `reward_accuracy` measures the held-out implicit-reward accuracy:
the fraction of pairs with β·(logπ − logπref)(chosen) > β·(logπ − logπref)(rejected).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_core.distributed import is_rank0
from mindspeed_core.files import staged_folder
from mindspeed_llm.data.collate import forward_packed
from mindspeed_llm.demo import NUMBER_WORDS, cache_root
from mindspeed_llm.sft_demo import demo_task, ensure_sft_demo

DEMO_VERSION = "v1"
NUM_TRAIN = 2000
NUM_HELDOUT = 200
SFT_STEPS = 150
"""Steps of the SFT warm start (the SFT demo's task and settings)."""


@dataclass(frozen=True)
class DPODemo:
    train: Path
    heldout: Path
    template: Path
    tokenizer: Path


def _pair(record: dict[str, str], rng: random.Random) -> dict[str, str]:
    right = NUMBER_WORDS.index(record["output"])
    wrong = rng.choice([w for i, w in enumerate(NUMBER_WORDS[:11]) if i != right])
    return {"prompt": record["instruction"], "chosen": record["output"], "rejected": wrong}


def ensure_dpo_demo(root: Path | None = None) -> DPODemo:
    """The demo's files, built on first use (call on one rank)."""
    root = root or cache_root()
    sft = ensure_sft_demo(root)
    folder = root / f"dpo-demo-{DEMO_VERSION}"
    demo = DPODemo(folder / "train.jsonl", folder / "heldout.jsonl", sft.template, sft.tokenizer)
    if demo.heldout.is_file():
        return demo
    with staged_folder(folder) as staging:  # all or nothing
        rng = random.Random(3)
        seen = {json.loads(line)["instruction"] for line in sft.train.read_text().splitlines()}
        train = [_pair(r, rng) for r in demo_task(NUM_TRAIN, seed=11)]
        heldout = [
            _pair(r, rng)
            for r in demo_task(8 * NUM_HELDOUT, seed=12)
            if r["instruction"] not in seen
        ]
        heldout = [p for p in heldout if p["prompt"] not in {t["prompt"] for t in train}][
            :NUM_HELDOUT
        ]
        for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
            (staging / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return demo


def use_demo_pairs(cfg) -> DPODemo:
    """Point `cfg.data` at the demo pairs (built on rank 0 first)."""
    if is_rank0():
        ensure_dpo_demo()
    if dist.is_initialized():
        dist.barrier()
    demo = ensure_dpo_demo()
    cfg.data.paths = [str(demo.train)]
    cfg.data.tokenizer = cfg.data.tokenizer or demo.tokenizer
    cfg.data.chat_template = cfg.data.chat_template or str(demo.template)
    return demo


def warm_start(cfg, info) -> dict[str, torch.Tensor]:
    """The model state after `SFT_STEPS` steps of the SFT demo (run directory
    `<logging.run_dir>/sft`; a finished one is reused), built like the DPO run's model."""
    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.sft_config import SFTConfig
    from mindspeed_llm.train.sft_data import SFTData
    from mindspeed_llm.train.trainer import Trainer

    sft_cfg = SFTConfig(model=cfg.model, parallel=cfg.parallel)
    sft_cfg.train.steps, sft_cfg.train.seed, sft_cfg.train.eval_interval = (
        SFT_STEPS,
        cfg.train.seed,
        0,
    )
    sft_cfg.logging.run_dir = Path(cfg.logging.run_dir) / "sft"
    sft_cfg.logging.progress = cfg.logging.progress
    trainer = Trainer(sft_cfg, info, data=SFTData, objective=NextToken(), command="sft")
    trainer.run()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@torch.no_grad()
def reward_accuracy(policy, reference, loss_ctx, batches, beta: float) -> dict[str, float]:
    """Over packed pair batches: the implicit-reward accuracy (chosen's β·log-ratio above the
    rejected's; with no reference, as SimPO and ORPO score: the per-token mean log-prob), the
    mean margin of those rewards, and the policy's own preference (logπ(chosen) > logπ(rejected))."""
    from mindspeed_align.logps import SLOT_KEY, sequence_logps

    right_reward = right_logp = total = 0
    margin = 0.0
    for batch in batches:
        num_slots = int(batch[SLOT_KEY].max()) + 1
        logps = []
        for model in (policy, reference) if reference is not None else (policy,):
            logits = forward_packed(model, batch)
            logps.append(
                sequence_logps(logits, batch["labels"], batch[SLOT_KEY], num_slots, loss_ctx)
            )
        (policy_logps, counts), ref = logps[0], logps[1:]
        ratio = beta * (policy_logps - ref[0][0]) if ref else policy_logps / counts.clamp(min=1)
        right_reward += int((ratio[0::2] > ratio[1::2]).sum())
        margin += float((ratio[0::2] - ratio[1::2]).sum())
        right_logp += int((policy_logps[0::2] > policy_logps[1::2]).sum())
        total += num_slots // 2
    return {"reward_accuracy": right_reward / total, "reward_margin": margin / total,
            "policy_preference": right_logp / total}  # fmt: skip
