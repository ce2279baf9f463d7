"""The policy-loss registry (`grpo.loss`) and its losses against their papers' formulas,
written out here per sequence and per token (values and gradients, 1e-6), and against
TRL's own `GRPOTrainer._compute_loss` on the same tensors (GSPO: importance_sampling_level
"sequence"; CISPO: loss_type "cispo"); the rollout correction (TIS) by hand; bad config
values as one line."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mindspeed_align.rl.config import GRPOSection
from mindspeed_align.rl.losses import (
    POLICY_LOSSES,
    aggregate,
    policy_loss,
    register_policy_loss,
    truncated_is_weights,
)
from mindspeed_core.errors import ConfigError

# 3 responses of 3, 4 and 2 tokens; one advantage per response
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.2, -1.5, -0.7, -0.9], [-3.0, -0.1, -0.4, -0.6]],
                    dtype=torch.float64)  # fmt: skip
OLD = torch.tensor([[-1.3, -0.5, -1.6, -0.3], [-0.2, -1.0, -1.2, -0.9], [-2.5, -0.1, -0.4, -0.6]],
                   dtype=torch.float64)  # fmt: skip
SAMPLER = torch.tensor([[-1.2, -0.4, -1.6, 0.0], [-1.0, -1.0, -1.3, -0.9], [-2.5, -0.2, 0.0, 0.0]],
                       dtype=torch.float64)  # fmt: skip
A = [1.2, -0.7, -1.5]
ADV = torch.tensor(A, dtype=torch.float64)[:, None].expand(3, 4)
SEQUENCES = torch.arange(3)[:, None].expand(3, 4)
LENGTHS = [3, 4, 2]


def _ours(name: str, eps_low: float, eps_high: float, agg: str):
    """(loss, d loss / d logp) of a registered loss, aggregated."""
    logp = LOGP.clone().requires_grad_()
    per_token, _ = POLICY_LOSSES[name].fn(logp, OLD, ADV, mask=MASK, sequences=SEQUENCES,
                                           eps_low=eps_low, eps_high=eps_high, dual_clip=None)  # fmt: skip
    loss = aggregate(per_token, MASK, agg)
    loss.backward()
    return loss.item(), logp.grad


def _gspo_by_hand(eps_low: float, eps_high: float):
    """GSPO (arXiv 2507.18071, eq. 5-7): s_i = exp(mean_t(logp - old)) over response i,
    J = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); its gradient in
    logp_i,t is s_i A_i / |y_i| (unclipped term active) or 0, over the batch of 3."""
    loss, grad = 0.0, torch.zeros(3, 4, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        s = math.exp(sum(LOGP[i, t].item() - OLD[i, t].item() for t in range(n)) / n)
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        loss += -min(s * A[i], clipped * A[i]) / 3
        if s * A[i] <= clipped * A[i]:  # the min takes the unclipped term: it has a gradient
            grad[i, :n] = -s * A[i] / n / 3
    return loss, grad


@pytest.mark.parametrize("eps", [(0.2, 0.28), (3e-4, 4e-4)], ids=["wide", "gspo_default"])
def test_gspo_is_the_papers_sequence_loss_value_and_gradient(eps):
    loss, grad = _ours("gspo", *eps, "seq-mean-token-mean")
    want, want_grad = _gspo_by_hand(*eps)
    assert loss == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    if eps == (0.2, 0.28):  # both branches live: response 2's s = e^-0.25 < 0.8 with A < 0
        assert (grad[2] == 0).all() and (grad[0, :3] != 0).all()


def _cispo_by_hand(eps_low: float, eps_high: float):
    """CISPO (arXiv 2506.13585, eq. 4-5): J = sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high))
    A_t log pi_t / (number of tokens), token-mean; the gradient in logp_t is the clipped
    weight times -A / 9 on every token (no token loses it)."""
    loss, grad = 0.0, torch.zeros(3, 4, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(LOGP[i, t].item() - OLD[i, t].item())
            w = min(max(r, 1 - eps_low), 1 + eps_high)
            loss += -w * A[i] * LOGP[i, t].item() / 9
            grad[i, t] = -w * A[i] / 9
    return loss, grad


@pytest.mark.parametrize("eps", [(0.2, 0.28), (1.0, 4.0)], ids=["verl_range", "trl_default"])
def test_cispo_is_the_papers_clipped_weight_loss_value_and_gradient(eps):
    loss, grad = _ours("cispo", *eps, "token-mean")
    want, want_grad = _cispo_by_hand(*eps)
    assert loss == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    assert (grad[MASK > 0] != 0).all()  # clipped or not, every token keeps a gradient


def test_defaults_come_from_the_registry_and_ppo_clip_is_todays_loss():
    assert (POLICY_LOSSES["ppo_clip"].clip_low, POLICY_LOSSES["ppo_clip"].clip_high) == (0.2, 0.2)
    gspo, cispo = GRPOSection(loss="gspo"), GRPOSection(loss="cispo")
    assert gspo.clip_range() == (3e-4, 4e-4) and gspo.aggregation() == "seq-mean-token-mean"
    assert cispo.clip_range() == (1.0, 4.0) and cispo.aggregation() == "token-mean"
    assert GRPOSection().clip_range() == (0.2, 0.2) and GRPOSection().aggregation() == "token-mean"
    assert GRPOSection(loss="gspo", clip_high=0.1, loss_agg="token-mean").clip_range() == (
        3e-4,
        0.1,
    )
    ours, _ = POLICY_LOSSES["ppo_clip"].fn(LOGP, OLD, ADV, mask=MASK, sequences=None, eps_low=0.2,
                                           eps_high=0.28, dual_clip=3.0)  # fmt: skip
    assert torch.equal(
        ours, policy_loss(LOGP, OLD, ADV, eps_low=0.2, eps_high=0.28, dual_clip=3.0)[0]
    )


def test_truncated_importance_sampling_by_hand():
    """TIS: each token's loss times min(exp(old - sampler), cap), no gradient through it."""
    weights = truncated_is_weights(OLD, SAMPLER, 2.0)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            want = min(math.exp(OLD[i, t].item() - SAMPLER[i, t].item()), 2.0)
            assert weights[i, t].item() == pytest.approx(want, abs=1e-6)
    assert weights[1, 0].item() == 2.0  # e^0.8 = 2.23 capped
    logp = LOGP.clone().requires_grad_()
    pg, _ = policy_loss(logp, OLD, ADV, eps_low=0.2, eps_high=0.28)
    aggregate(pg * truncated_is_weights(OLD, SAMPLER, 2.0), MASK).backward()
    plain = LOGP.clone().requires_grad_()
    pg_plain, _ = policy_loss(plain, OLD, ADV, eps_low=0.2, eps_high=0.28)
    aggregate(pg_plain, MASK).backward()
    torch.testing.assert_close(logp.grad, plain.grad * weights)


def test_a_policy_loss_registered_with_one_decorated_function_is_a_config_choice():
    @register_policy_loss("test_pg", clip_low=0.1, clip_high=0.1)
    def vanilla_pg(logp, old_logp, advantages, *, mask, sequences, eps_low, eps_high, dual_clip):
        return -advantages * logp, torch.zeros_like(logp)

    try:
        assert GRPOSection(loss="test_pg").clip_range() == (0.1, 0.1)
        with pytest.raises(ValueError, match="registered already"):
            register_policy_loss("test_pg")(vanilla_pg)
    finally:
        POLICY_LOSSES.pop("test_pg")
    with pytest.raises(
        ConfigError, match=r"grpo.loss='test_pg' is not one of \('ppo_clip', 'gspo', 'cispo'\)"
    ):
        GRPOSection(loss="test_pg")


@pytest.mark.parametrize("options,message", [
    ({"loss": "gpso"}, "grpo.loss='gpso' is not one of ('ppo_clip', 'gspo', 'cispo')"),
    ({"loss": "gspo", "dual_clip": 3.0}, "grpo.dual_clip=3.0: grpo.loss=gspo takes no dual clip"),
    ({"rollout_correction_cap": 0.5}, "grpo.rollout_correction_cap=0.5 must be >= 1"),
    ({"loss": "cispo", "clip_low": 1.5}, "grpo.clip_low=1.5 / clip_high=4.0"),
])  # fmt: skip
def test_bad_loss_settings_name_the_field(options, message):
    with pytest.raises(ConfigError) as err:
        GRPOSection(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- TRL's own GRPOTrainer._compute_loss on the same tensors ------------------------------


def _trl(loss_type: str, level: str, eps_low: float, eps_high: float):
    """(loss, d loss / d logp) from TRL's `GRPOTrainer._compute_loss` on our tensors."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp = LOGP.clone().requires_grad_()
    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        aux_loss_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        loss_type=loss_type, beta=0.0, epsilon_low=eps_low, epsilon_high=eps_high,
        max_completion_length=4,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x,
                                    reduce=lambda x, reduction: x, sync_gradients=True),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(LOGP), None),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2),
        "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": MASK,
        "advantages": ADV[:, 0], "old_per_token_logps": OLD, "num_items_in_batch": MASK.sum(),
    }  # fmt: skip
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.item(), logp.grad


def test_gspo_equals_trls_sequence_level_importance_sampling():
    pytest.importorskip("trl")
    for eps in ((0.2, 0.28), (3e-4, 4e-4)):
        loss, grad = _ours("gspo", *eps, "seq-mean-token-mean")
        trl_loss, trl_grad = _trl("grpo", "sequence", *eps)
        assert loss == pytest.approx(trl_loss, abs=1e-6)
        torch.testing.assert_close(grad, trl_grad, atol=1e-6, rtol=0)


def test_cispo_equals_trls_cispo_loss():
    """TRL's "cispo" clamps the weight at epsilon_high (an absolute cap, 5.0 recommended)
    with no lower bound: ours with eps_low 1.0 and eps_high cap - 1."""
    pytest.importorskip("trl")
    for cap in (1.5, 5.0):  # 1.5: the cap is live (e^0.5 = 1.65 on response 1)
        loss, grad = _ours("cispo", 1.0, cap - 1, "token-mean")
        trl_loss, trl_grad = _trl("cispo", "token", 0.2, cap)
        assert loss == pytest.approx(trl_loss, abs=1e-6)
        torch.testing.assert_close(grad, trl_grad, atol=1e-6, rtol=0)
