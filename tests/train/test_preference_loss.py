"""Preference losses (llmkit.train.preference) on hand-computed pairs."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.train.preference import Pairs, answer_logps, preference_loss


def _pairs(chosen, rejected, chosen_tokens, rejected_tokens) -> Pairs:
    t = torch.tensor
    return Pairs(t(chosen), t(rejected), t(chosen_tokens), t(rejected_tokens))


POLICY = _pairs([-10.0, -20.0], [-14.0, -18.0], [5, 10], [7, 6])
REFERENCE = _pairs([-12.0, -19.0], [-13.0, -19.0], [5, 10], [7, 6])


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_by_hand():
    beta = 0.1
    out = preference_loss("dpo", POLICY, REFERENCE, beta)
    # pair 1: log-ratios +2 (chosen) and -1 (rejected): rewards 0.2, -0.1; pair 2: -1 and +1: rewards -0.1, 0.1
    expected = (-math.log(_sigmoid(0.3)) - math.log(_sigmoid(-0.2))) / 2
    assert out["loss"].item() == pytest.approx(expected)
    assert out["reward_chosen"].item() == pytest.approx((0.2 - 0.1) / 2)
    assert out["reward_rejected"].item() == pytest.approx((-0.1 + 0.1) / 2)
    assert out["reward_margin"].item() == pytest.approx((0.3 - 0.2) / 2)
    assert out["reward_accuracy"].item() == 0.5


def test_ipo_by_hand():
    beta = 0.5
    out = preference_loss("ipo", POLICY, REFERENCE, beta)
    h = [2 / 5 - (-1) / 7, -1 / 10 - 1 / 6]  # log-ratios averaged over each answer's tokens
    assert out["loss"].item() == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in h) / 2)
    assert out["reward_margin"].item() == pytest.approx(beta * ((2 + 1) + (-1 - 1)) / 2)  # DPO's rewards


def test_simpo_by_hand_needs_no_reference():
    beta, gamma = 2.0, 0.5
    out = preference_loss("simpo", POLICY, None, beta, gamma)
    margins = [beta * (-10 / 5 - -14 / 7) - gamma, beta * (-20 / 10 - -18 / 6) - gamma]
    assert out["loss"].item() == pytest.approx(sum(-math.log(_sigmoid(m)) for m in margins) / 2)
    assert out["reward_accuracy"].item() == 0.5  # pair 1: -2 against -2 is no win
    with pytest.raises(ValueError, match="reference"):
        preference_loss("dpo", POLICY, None, beta)


def test_answer_logps_sums_only_the_answer_s_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    targets = torch.tensor([[-100, 3, 1, -100], [2, -100, -100, -100]])
    logps, counts = answer_logps(logits, targets)
    logp = logits.log_softmax(-1)
    assert counts.tolist() == [2, 1]
    torch.testing.assert_close(logps, torch.stack([logp[0, 1, 3] + logp[0, 2, 1], logp[1, 0, 2]]))
