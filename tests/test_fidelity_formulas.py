"""The formulas whose names promise a reference's numbers: veRL's k3 KL and REINFORCE++-baseline.

Each expected value is worked out by hand from the reference's definition (quoted in the test).
flow-GRPO's per-prompt advantages are tested in test_flow_sde.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algos.advantages import get_advantage_estimator, reinforce_pp_baseline_advantages
from mmrl.algos.kl import kl_estimate, kl_in_loss


def _k3_and_grad(ref_minus_logp: float) -> tuple[float, float]:
    logp = torch.tensor([[0.0]], requires_grad=True)
    ref = torch.tensor([[ref_minus_logp]])
    value = kl_estimate(logp, ref, "k3")
    value.sum().backward()
    return value.item(), logp.grad.item()


# veRL `low_var_kl`: kl = clamp(ref - logp, -20, 20); k3 = exp(kl) - kl - 1, clamped to [-10, 10].
# d k3 / d logp = 1 - exp(ref - logp) inside both clamps, 0 outside either.
@pytest.mark.parametrize(
    ("d", "value", "grad"),
    [
        (0.0, 0.0, 0.0),
        (1.0, math.e - 2, 1 - math.e),
        (2.5, math.exp(2.5) - 3.5, 1 - math.exp(2.5)),  # 8.68 < 10: not clamped, grad -11.18
        (-5.0, math.exp(-5) + 4, 1 - math.exp(-5)),
        (4.0, 10.0, 0.0),  # e^4 - 5 = 49.6 -> 10; the unclamped gradient would be -53.6
        (20.0, 10.0, 0.0),  # at the exponent clamp the unclamped gradient would be 1 - e^20
        (-30.0, 10.0, 0.0),  # exponent clamped to -20: e^-20 + 19 -> 10
    ],
)
def test_k3_value_and_gradient_match_verl(d: float, value: float, grad: float):
    got_value, got_grad = _k3_and_grad(d)
    assert got_value == pytest.approx(value, rel=1e-6, abs=1e-7)
    assert got_grad == pytest.approx(grad, rel=1e-6, abs=1e-7)


def test_k3_gradient_is_bounded_in_the_loss():
    # One token far below the reference (ref - logp = 6) beside one close to it (0.5): the far
    # token's k3 is clamped, so only the close one sends a gradient, 1 - e^0.5, over 2 tokens.
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[6.0, 0.5]])
    loss = kl_in_loss(logp, ref, torch.ones(1, 2), estimator="k3")
    loss.backward()
    assert loss.item() == pytest.approx((10.0 + math.exp(0.5) - 1.5) / 2, rel=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([0.0, (1 - math.exp(0.5)) / 2], rel=1e-6)


def test_reinforce_pp_baseline_whitens_per_token_like_verl():
    # G = 2, rewards [1, 0 | 1, 1] with 1, 3, 2, 2 response tokens.
    # x = r - group mean = [0.5, -0.5, 0, 0]; T = 8 tokens
    # mu = (0.5*1 - 0.5*3) / 8 = -0.125; deviations 0.625, -0.375, 0.125, 0.125
    # var = (1*0.625^2 + 3*0.375^2 + 2*0.125^2 + 2*0.125^2) / 8 * 8/7 = 0.875 / 7 = 0.125
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    counts = torch.tensor([1, 3, 2, 2])
    adv = reinforce_pp_baseline_advantages(r, 2, token_counts=counts)
    std = math.sqrt(0.125 + 1e-8)
    assert adv.tolist() == pytest.approx([0.625 / std, -0.375 / std, 0.125 / std, 0.125 / std], rel=1e-6)
    # Per response (no counts, or equal lengths): mu = 0, var = 0.5 / 3
    flat = reinforce_pp_baseline_advantages(r, 2)
    s = math.sqrt(0.5 / 3)
    assert flat.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0], rel=1e-6)
    # Equal lengths (5 tokens each) still differ from per response through Bessel's correction
    # over tokens: var = 5 * 0.5 / 20 * 20/19 = 2.5 / 19
    equal = reinforce_pp_baseline_advantages(r, 2, token_counts=torch.tensor([5, 5, 5, 5]))
    s = math.sqrt(2.5 / 19)
    assert equal.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0], rel=1e-6)


def test_reinforce_pp_baseline_single_response_group_keeps_its_reward():
    # veRL: a prompt with one response has baseline 0, so x = r. Row 1 is invalid (dropped):
    # left out and given 0. x = [1, -, -1, 1]; mu = 1/3; var = (4/9 + 16/9 + 4/9) / 3 * 3/2 = 4/3
    r = torch.tensor([1.0, 0.0, 3.0, 5.0])
    valid = torch.tensor([True, False, True, True])
    adv = reinforce_pp_baseline_advantages(r, 2, valid=valid)
    s = math.sqrt(4 / 3)
    assert adv.tolist() == pytest.approx([(2 / 3) / s, 0.0, (-4 / 3) / s, (2 / 3) / s], rel=1e-6)


def test_reinforce_pp_baseline_degenerate_batches_are_zero():
    est = get_advantage_estimator("reinforce_pp_baseline")
    assert est(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2).tolist() == [0.0] * 4  # no spread
    # a row with no token is out of the statistics and gets 0
    adv = est(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, token_counts=torch.tensor([2, 2, 0, 2]))
    assert adv[2].item() == 0.0 and adv[0].item() > 0 > adv[1].item()
    with pytest.raises(ValueError, match="token_counts"):
        est(torch.tensor([1.0, 0.0]), 2, token_counts=torch.tensor([1, 2, 3]))
