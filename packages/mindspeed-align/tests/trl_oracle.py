"""TRL's own loss code called on given per-sequence log-probs (test-only oracle).

TRL 1.x computes its DPO and KTO losses inside ``_compute_loss`` from model outputs; these helpers
call those methods unbound on a stand-in ``self`` and a stand-in model whose per-token log-probs
sum to the given per-sequence values, so TRL's own arithmetic runs on our numbers.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)


def _per_token(logps: torch.Tensor, lengths: torch.Tensor, width: int):
    """Per-token log-probs (rows, width) summing to ``logps`` over ``lengths`` tokens, and the
    completion mask (rows, width + 1) TRL shifts by one."""
    rows = logps.shape[0]
    per_token = torch.zeros(rows, width, dtype=torch.float64)
    mask = torch.zeros(rows, width + 1, dtype=torch.long)
    for i in range(rows):
        n = int(lengths[i])
        per_token[i, :n] = logps[i] / n
        mask[i, 1 : n + 1] = 1
    return per_token, mask


def _fake_model(per_token: torch.Tensor):
    out = SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros_like(per_token),
        mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros_like(per_token, dtype=torch.bool),
    )
    return lambda **kwargs: out


def trl_dpo(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, loss, beta, label_smoothing):
    """TRL's ``DPOTrainer._compute_loss`` (precomputed reference) -> (loss, metrics)."""
    from trl import DPOTrainer

    width = int(max(chosen_len.max(), rejected_len.max())) + 1
    per_token, mask = _per_token(torch.cat([chosen, rejected]), torch.cat([chosen_len, rejected_len]), width)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
        "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
    }
    loss_value = DPOTrainer._compute_loss(fake, _fake_model(per_token), inputs, False)
    return float(loss_value), {k: v[-1] for k, v in fake._metrics["train"].items()}


def trl_cpo(chosen_avg, rejected_avg, *, loss, beta, simpo_gamma, label_smoothing):
    """TRL's ``CPOTrainer.cpo_loss`` -> (losses, chosen_rewards, rejected_rewards)."""
    from trl.experimental.cpo import CPOTrainer

    fake = SimpleNamespace(alpha=0.0, accelerator=_accelerator(), loss_type=loss, beta=beta,
                           simpo_gamma=simpo_gamma, label_smoothing=label_smoothing)
    return CPOTrainer.cpo_loss(fake, chosen_avg, rejected_avg)


def trl_orpo(chosen_avg, rejected_avg, *, beta):
    """TRL's ``ORPOTrainer.odds_ratio_loss`` -> (beta·logσ(log_odds), chosen_rewards, rejected_rewards)."""
    from trl.experimental.orpo import ORPOTrainer

    fake = SimpleNamespace(beta=beta, accelerator=_accelerator())
    return ORPOTrainer.odds_ratio_loss(fake, chosen_avg, rejected_avg)[:3]
