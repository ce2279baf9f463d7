"""The RL math against its formulas: values written here (computed by hand from the
formulas of TRL's GRPOTrainer/RLOOTrainer and verl's core_algos), and TRL's own
`GRPOTrainer._compute_loss` on the same fixed tensors where trl is installed."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mindspeed_align.rl.advantages import (
    dr_grpo,
    gae,
    group_normalized,
    reinforce_pp,
    rloo,
)
from mindspeed_align.rl.losses import aggregate, kl_estimate, policy_loss, token_weights

R = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.2, 0.9])
G = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float)
TOKEN_REWARDS = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0.5], [0, -1.0, 0, 0]])
VALUES = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.4, 0.3, 0.2], [-0.1, 0.0, 0.0, 0.0]])
# A rollout of 3 responses, 4 tokens: the policy moved away from the sampler on some tokens.
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.2, -1.5, -0.7, -0.9], [-3.0, -0.1, -0.4, -0.6]])
OLD = torch.tensor([[-1.3, -0.5, -1.6, -0.3], [-0.2, -1.0, -1.2, -0.9], [-2.5, -0.1, -0.4, -0.6]])
REF = torch.tensor([[-1.1, -0.7, -2.0, -0.2], [-0.4, -1.5, -0.5, -1.0], [-3.2, -0.3, -0.4, -0.5]])
ADV = torch.tensor([1.2, -0.7, -1.5])[:, None].expand(3, 4)


def test_outcome_advantages():
    table = {
        # (r - mean_g) / (std_g + 1e-6), unbiased std (verl)
        "grpo": (
            group_normalized(R, G),
            [
                0.78334785,
                -1.30557966,
                -0.26111594,
                0.78334785,
                -0.64372480,
                -0.64372480,
                -0.17556129,
                1.46301091,
            ],
        ),
        # TRL's eps 1e-4
        "grpo_trl": (
            group_normalized(R, G, eps=1e-4),
            [
                0.78318584,
                -1.30530977,
                -0.26106194,
                0.78318584,
                -0.64357567,
                -0.64357567,
                -0.17552061,
                1.46267200,
            ],
        ),
        # TRL scale_rewards="batch": the whole batch's std
        "batch": (
            group_normalized(R, G, scale="batch", eps=1e-4),
            [
                0.81537050,
                -1.35895085,
                -0.27179018,
                0.81537050,
                -0.59793836,
                -0.59793836,
                -0.16307408,
                1.35895073,
            ],
        ),
        "dr_grpo": (dr_grpo(R, G), [0.375, -0.625, -0.125, 0.375, -0.275, -0.275, -0.075, 0.625]),
        # r_i - mean of the others
        "rloo": (rloo(R, G), [0.5, -5 / 6, -1 / 6, 0.5, -0.11 / 0.3, -0.11 / 0.3, -0.1, 2.5 / 3]),
    }
    for name, (got, want) in table.items():
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0, msg=name)
    # a group with equal rewards has advantage 0 (the "loss is 0" groups), never nan
    flat = group_normalized(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert flat[:2].tolist() == [0.0, 0.0] and flat[2] < 0 < flat[3]


def test_token_advantages_reinforce_pp_and_gae():
    rpp = reinforce_pp(TOKEN_REWARDS, MASK)
    want = [[0.84327406, 0.84327406, 0.84327406, 0], [0.21081851] * 4,
            [-1.68654823, -1.68654823, 0, 0]]  # fmt: skip
    torch.testing.assert_close(rpp, torch.tensor(want), atol=1e-6, rtol=0)
    rpp = reinforce_pp(TOKEN_REWARDS, MASK, gamma=0.9)
    want = [[0.72025627, 0.84280807, 0.97897673, 0], [0.11362512, 0.16877343, 0.23004933, 0.29813367],
            [-1.60822701, -1.74439573, 0, 0]]  # fmt: skip
    torch.testing.assert_close(rpp, torch.tensor(want), atol=1e-6, rtol=0)
    adv, returns = gae(TOKEN_REWARDS, VALUES, MASK, gamma=0.99, lam=0.95)
    want = [[1.07343054, 0.99267656, 0.90843195, 0], [-0.22018938, -0.05588172, 0.11720238, 0.29961818],
            [-1.43626201, -1.67902660, 0, 0]]  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor(want), atol=1e-6, rtol=0)
    # returns = A + V before whitening: the last token's return is its reward
    torch.testing.assert_close(
        returns[:, :3][MASK[:, :3] > 0][:3], torch.tensor([0.90840667, 0.95535, 1.0])
    )


def test_kl_estimators():
    d = LOGP - REF
    torch.testing.assert_close(kl_estimate(LOGP, REF, "k1"), d)
    torch.testing.assert_close(kl_estimate(LOGP, REF, "k2"), 0.5 * d * d)
    torch.testing.assert_close(kl_estimate(LOGP, REF, "k3"), torch.exp(-d) + d - 1)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-30.0]), "k3", clamp=10).item() == 10
    # at a point: logp=-1, ref=-1.1 -> k1 0.1, k2 0.005, k3 exp(-0.1)+0.1-1
    one = [
        kl_estimate(torch.tensor(-1.0), torch.tensor(-1.1), k).item() for k in ("k1", "k2", "k3")
    ]
    assert one == pytest.approx([0.1, 0.005, math.exp(-0.1) - 0.9], abs=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(LOGP, REF, "k4")


def test_policy_loss_clip_dual_clip_and_aggregation():
    loss, clipped = policy_loss(LOGP, OLD, ADV, eps_low=0.2, eps_high=0.28)
    r = torch.exp(LOGP - OLD)
    # token (0,0): ratio e^0.3 = 1.35 > 1.28 with A > 0 -> clipped at 1.28
    assert loss[0, 0].item() == pytest.approx(-1.2 * 1.28) and clipped[0, 0] == 1
    # token (0,2): ratio e^-0.4 = 0.67 with A > 0 -> unclipped (the min takes the ratio)
    assert loss[0, 2].item() == pytest.approx(-1.2 * r[0, 2].item()) and clipped[0, 2] == 0
    # token (1,1): ratio e^-0.5 = 0.61 < 0.8 with A < 0 -> clipped at 0.8
    assert loss[1, 1].item() == pytest.approx(0.7 * 0.8) and clipped[1, 1] == 1
    # token (2,0): ratio e^-0.5 with A < 0 -> clip at 0.8; (1,2): ratio e^0.5 = 1.65 -> unclipped
    assert loss[1, 2].item() == pytest.approx(0.7 * math.exp(0.5))
    dual, dclip = policy_loss(LOGP + torch.tensor([[0, 0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 0]]),
                              OLD, ADV, dual_clip=3.0)  # fmt: skip
    assert dual[1, 2].item() == pytest.approx(0.7 * 3.0) and dclip[1, 2] == 1  # ratio e^1.5 > 3
    # aggregations (verl's loss_agg_mode), hand values on loss
    masked = loss * MASK
    assert aggregate(loss, MASK, "token-mean").item() == pytest.approx(masked.sum().item() / 9)
    per_seq = masked.sum(-1) / MASK.sum(-1)
    assert aggregate(loss, MASK, "seq-mean-token-mean").item() == pytest.approx(
        per_seq.mean().item()
    )
    assert aggregate(loss, MASK, "seq-mean-token-sum").item() == pytest.approx(
        masked.sum().item() / 3
    )
    norm = aggregate(loss, MASK, "seq-mean-token-sum-norm", max_len=8).item()
    assert norm == pytest.approx(masked.sum().item() / (3 * 8))
    weights, units = token_weights(MASK, "token-mean")
    assert units.item() == 9 and torch.equal(weights, MASK)
    with pytest.raises(ValueError, match="max_len"):
        token_weights(MASK, "seq-mean-token-sum-norm")


# -- TRL's own loss on the same tensors --------------------------------------------------

TRL_AGG = {  # TRL's loss_type -> our aggregation (eps_low 0.2, eps_high 0.28, k3 KL)
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _ours(loss_type: str, beta: float) -> float:
    agg = TRL_AGG[loss_type]
    pg, _ = policy_loss(LOGP, OLD, ADV, eps_low=0.2, eps_high=0.28)
    return aggregate(pg + beta * kl_estimate(LOGP, REF, "k3"), MASK, agg, max_len=4).item()


def _trl(loss_type: str, beta: float) -> float:
    from trl.trainer.grpo_trainer import GRPOTrainer

    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        aux_loss_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
        max_completion_length=4, args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x,
                                    reduce=lambda x, reduction: x, sync_gradients=True),
        _get_per_token_logps_and_entropies=lambda *a, **k: (LOGP, torch.zeros_like(LOGP), None),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2),
        "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": MASK,
        "advantages": ADV[:, 0], "old_per_token_logps": OLD, "ref_per_token_logps": REF,
    }  # fmt: skip
    return GRPOTrainer._compute_loss(stub, None, inputs).item()


# computed once with the formulas above and confirmed equal to TRL 1.16's _compute_loss
WRITTEN = {
    ("grpo", 0.0): 0.31613273,
    ("grpo", 0.04): 0.31663713,
    ("bnpo", 0.0): 0.25263566,
    ("bnpo", 0.04): 0.25310674,
    ("dr_grpo", 0.0): 0.18947674,
    ("dr_grpo", 0.04): 0.18983006,
}


@pytest.mark.parametrize("loss_type,beta", sorted(WRITTEN))
def test_grpo_loss_equals_trl(loss_type, beta):
    assert _ours(loss_type, beta) == pytest.approx(WRITTEN[(loss_type, beta)], abs=1e-6)
    pytest.importorskip("trl")
    assert _ours(loss_type, beta) == pytest.approx(_trl(loss_type, beta), abs=1e-6)


def test_trainer_advantages_per_token():
    from mindspeed_align.rl.advantages import token_advantages as compute_advantages
    from mindspeed_align.rl.grpo import _flat_groups

    rewards, group, lengths = R.tolist(), G.tolist(), [1, 2, 3, 1, 2, 2, 1, 3]
    for kind, fn in (("grpo", group_normalized), ("dr_grpo", dr_grpo), ("rloo", rloo)):
        per_token = compute_advantages(kind, rewards, group, lengths)
        assert [len(a) for a in per_token] == lengths
        want = fn(R.double(), G).tolist()
        assert [a[-1] for a in per_token] == pytest.approx(want, abs=1e-6), kind
    rpp = compute_advantages("reinforce_pp", rewards, group, lengths)
    mask = torch.tensor([[float(t < n) for t in range(3)] for n in lengths])
    token_rewards = torch.zeros(8, 3)
    token_rewards[torch.arange(8), torch.tensor(lengths) - 1] = R
    want = reinforce_pp(token_rewards, mask)
    assert [x for a in rpp for x in a] == pytest.approx(want[mask > 0].tolist(), abs=1e-5)
    assert _flat_groups([1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1]) == [True, False]


def test_overlong_penalty_is_dapos_soft_punishment():
    """verl's overlong_buffer: expected = max_len - buffer, reward += min(-(len - expected) /
    buffer * factor, 0): nothing up to expected, then linear to -factor at max_len."""
    from mindspeed_align.rl.advantages import overlong_penalty
    from mindspeed_align.rl.config import GRPOSection
    from mindspeed_core.errors import ConfigError

    assert overlong_penalty([1, 4, 5, 6, 8], max_len=8, buffer=4, factor=0.5) == [0.0, 0.0, -0.125, -0.25, -0.5]
    with pytest.raises(ConfigError, match="grpo.overlong_buffer=4 must be in"):
        GRPOSection(max_new_tokens=4, overlong_buffer=4)
