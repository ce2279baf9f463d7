"""A reward model as an RL reward: a Hugging Face `*ForSequenceClassification` folder (what
`mindspeed rm --rm.export_hf` writes) scoring each prompt + completion in the trainer's
process, beside the rule rewards (`rewards.Rewards`).

The text prompt + completion is tokenized with the reward model's own tokenizer (its
folder's; else the policy's), as verl does when the two differ, so a reward model of
another family can judge the policy. Every rank holds a whole copy and scores its own
samples (no gradients); sequences are packed into rows of at most `row_tokens` tokens,
and a sequence's score is the head's output at its last token (transformers' pooling).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from mindspeed_align.reward import load_classifier
from mindspeed_core.errors import ConfigError

__all__ = ["RewardModel", "section_rewards"]


class RewardModel:
    """Scores texts with the classifier at `path`.

    Args:
        path: the `*ForSequenceClassification` folder.
        fallback_tokenizer: used when the folder has no tokenizer of its own.
        device: where the model runs.
        row_tokens: tokens per packed forward at most.
    """

    def __init__(self, path: Path, fallback_tokenizer, device="cpu", *, row_tokens: int = 4096,
                 what: str = "grpo.reward_model"):  # fmt: skip
        from mindspeed_llm.tokenizer import load_tokenizer

        if not Path(path).is_dir():
            raise ConfigError(f"{what}: no folder {path}")
        try:
            self.model, self.config, _ = load_classifier(path, device)
        except ConfigError as err:
            raise ConfigError(f"{what}: {err}") from None
        has_own = any((Path(path) / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
        self.tokenizer = load_tokenizer(path) if has_own else fallback_tokenizer
        self.device, self.row_tokens = torch.device(device), row_tokens

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """The score of each prompt + completion."""
        seqs = [self.tokenizer.encode(p + c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        row: list[list[int]] = []
        for seq in seqs:
            if row and sum(map(len, row)) + len(seq) > self.row_tokens:
                scores += self._score_row(row)
                row = []
            row.append(seq[-self.row_tokens :])
        return scores + (self._score_row(row) if row else [])

    def _score_row(self, seqs: list[list[int]]) -> list[float]:
        ids = torch.tensor([[t for s in seqs for t in s]], device=self.device)
        positions = torch.tensor([[i for s in seqs for i in range(len(s))]], device=self.device)
        bounds = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()],
                              dtype=torch.int32, device=self.device)  # fmt: skip
        out = self.model(ids, position_ids=positions, cu_seqlens=bounds)  # (1, tokens, 1)
        return out[0, bounds[1:].long() - 1, 0].float().tolist()


def section_rewards(rl, tokenizer, device="cpu"):
    """The rewards an RL section names: its rule functions (`rewards.Rewards`, in worker
    processes), LLM judges and code tests, and its reward model, weighted; used in the training process (colocated)
    and inside a Ray reward actor alike."""
    from mindspeed_align.rl.rewards import Rewards

    model = None
    if rl.reward_model is not None:
        model = RewardModel(rl.reward_model, tokenizer, device, what=f"{rl.section}.reward_model")
    return Rewards(rl.rewards, rl.reward_weights, workers=rl.reward_workers,
                   timeout_s=rl.reward_timeout_s, model=model,
                   model_weight=rl.reward_model_weight, section=rl.section)  # fmt: skip
