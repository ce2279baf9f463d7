"""Each preference loss against TRL's own code on the same log-prob tensors.

The expected mean losses are written below (from TRL 1.16) so the table runs without trl; the
live half calls TRL (see trl_oracle.py) and is skipped only when trl is missing.
"""

import importlib.util

import pytest
import torch

from mindspeed_align.losses import (
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_loss,
    reward_metrics,
    simpo_loss,
)
from mindspeed_core.testing import import_sibling

_oracle = import_sibling(__file__, "trl_oracle")
trl_cpo, trl_dpo, trl_orpo = _oracle.trl_cpo, _oracle.trl_dpo, _oracle.trl_orpo
HAS_TRL = importlib.util.find_spec("trl") is not None
D = torch.float64
CHOSEN = torch.tensor([-5.0, -12.3, -3.1, -8.0], dtype=D)
REJECTED = torch.tensor([-6.5, -10.0, -7.2, -8.4], dtype=D)
REF_CHOSEN = torch.tensor([-5.5, -11.0, -4.0, -7.7], dtype=D)
REF_REJECTED = torch.tensor([-6.0, -10.9, -6.1, -9.0], dtype=D)
LEN_CHOSEN = torch.tensor([5, 9, 3, 7])
LEN_REJECTED = torch.tensor([6, 8, 5, 7])
AVG_CHOSEN, AVG_REJECTED = CHOSEN / LEN_CHOSEN, REJECTED / LEN_REJECTED


def _dpo(loss, beta, eps):
    return dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, loss=loss, label_smoothing=eps,
                    chosen_lengths=LEN_CHOSEN, rejected_lengths=LEN_REJECTED)


def _trl_dpo(loss, beta, eps):
    return trl_dpo(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, LEN_CHOSEN, LEN_REJECTED,
                   loss=loss, beta=beta, label_smoothing=eps)[0]


# name, ours (mean loss), TRL's (mean loss), expected value (TRL 1.16)
CASES = [
    ("dpo-sigmoid", lambda: _dpo("sigmoid", 0.1, 0.0), lambda: _trl_dpo("sigmoid", 0.1, 0.0), 0.6977199718578413),
    ("dpo-hinge", lambda: _dpo("hinge", 0.5, 0.0), lambda: _trl_dpo("hinge", 0.5, 0.0), 1.0125000000000006),
    ("dpo-ipo", lambda: _dpo("ipo", 0.1, 0.0), lambda: _trl_dpo("ipo", 0.1, 0.0), 24.30209689192807),
    ("dpo-robust", lambda: _dpo("robust", 0.1, 0.2), lambda: _trl_dpo("robust", 0.1, 0.2), 0.6985533051911748),
    # cDPO: TRL >= 0.29 dropped label smoothing from DPO's sigmoid; its CPO sigmoid on the
    # log-ratios keeps the cDPO formula MindSpeed-LLM and OpenRLHF use.
    ("cdpo-sigmoid", lambda: _dpo("sigmoid", 0.1, 0.2),
     lambda: trl_cpo(CHOSEN - REF_CHOSEN, REJECTED - REF_REJECTED, loss="sigmoid", beta=0.1, simpo_gamma=0.0,
                     label_smoothing=0.2)[0].mean(), 0.6972199718578411),
    ("simpo", lambda: simpo_loss(AVG_CHOSEN, AVG_REJECTED, beta=2.0, gamma=0.5, label_smoothing=0.1),
     lambda: trl_cpo(AVG_CHOSEN, AVG_REJECTED, loss="simpo", beta=2.0, simpo_gamma=0.5,
                     label_smoothing=0.1)[0].mean(), 0.8346264502668015),
    # TRL returns β·logσ(log_odds) and subtracts it; ours is the loss itself, so the signs differ.
    ("orpo", lambda: orpo_loss(AVG_CHOSEN, AVG_REJECTED, beta=0.1),
     lambda: -trl_orpo(AVG_CHOSEN, AVG_REJECTED, beta=0.1)[0].mean(), 0.06264401972293854),
]


def _mean(x):
    return float(x.losses.mean()) if hasattr(x, "losses") else float(x)


@pytest.mark.parametrize("name,ours,theirs,expected", CASES, ids=[c[0] for c in CASES])
def test_loss_table(name, ours, theirs, expected):
    assert _mean(ours()) == pytest.approx(expected, rel=1e-6)
    if HAS_TRL:
        assert _mean(ours()) == pytest.approx(float(theirs()), rel=1e-6)


def test_dpo_rewards_and_metrics_match_trl():
    out = _dpo("sigmoid", 0.1, 0.0)
    metrics = reward_metrics(out)
    expected = {"rewards/chosen": -0.005, "rewards/rejected": -0.0025, "rewards/margins": -0.0025,
                "rewards/accuracies": 0.5}
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    if HAS_TRL:
        trl_metrics = trl_dpo(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, LEN_CHOSEN, LEN_REJECTED,
                              loss="sigmoid", beta=0.1, label_smoothing=0.0)[1]
        for key, value in metrics.items():
            assert value == pytest.approx(trl_metrics[key], abs=1e-12), key
    with pytest.raises(ValueError, match="needs chosen_lengths"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, loss="ipo")


def test_kto_matches_trl_formula():
    """TRL's KTO (kto_trainer._compute_loss): z = clamp(mean(kl ratio), 0), desirable
    1 − σ(β(ρ − z)), undesirable 1 − σ(β(z − ρ)), weighted; loss = mean over the batch."""
    labels = torch.tensor([True, False, True, False])
    kl = kto_kl_estimate(CHOSEN, REF_REJECTED)
    assert float(kl) == pytest.approx(0.9)  # mean([1.0, -1.4, 3.0, 1.0])
    assert float(kto_kl_estimate(REJECTED, REF_CHOSEN)) == 0.0  # clamped at zero
    out = kto_loss(CHOSEN, REF_CHOSEN, labels, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.5)
    ratio = CHOSEN - REF_CHOSEN
    by_hand = [1 - torch.sigmoid(0.1 * (ratio[0] - 0.9)), 1.5 * (1 - torch.sigmoid(0.1 * (0.9 - ratio[1]))),
               1 - torch.sigmoid(0.1 * (ratio[2] - 0.9)), 1.5 * (1 - torch.sigmoid(0.1 * (0.9 - ratio[3])))]
    torch.testing.assert_close(out.losses, torch.stack(by_hand))
    assert float(out.losses.mean()) == pytest.approx(0.5957209341430714, rel=1e-6)
    torch.testing.assert_close(out.chosen_rewards, 0.1 * ratio[labels])
