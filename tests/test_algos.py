"""Advantages, the clipped policy loss and KL estimators against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algos.advantages import get_advantage_estimator, group_advantages
from mmrl.algos.kl import kl_estimate
from mmrl.algos.losses import clipped_policy_loss, masked_mean


def test_group_advantages_by_hand():
    # Group 1: rewards [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    # Group 2: rewards [1, 1, 0, 0]: mean 0.5, std sqrt(4 * 0.25 / 3) = 0.57735.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [1.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_all_equal_and_single_sample_groups_have_zero_advantage():
    assert group_advantages(torch.tensor([0.7, 0.7, 0.7]), 3).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(torch.tensor([1.0, 0.0]), 1).tolist() == [0.0, 0.0]


def test_group_advantages_reject_a_ragged_batch():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_estimators_are_selected_by_name():
    assert get_advantage_estimator("grpo") is group_advantages
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        get_advantage_estimator("nope")


def _loss_per_token(ratio: float, adv: float, clip_low=0.2, clip_high=0.28):
    logprob = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = clipped_policy_loss(
        logprob, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), clip_low, clip_high
    )
    loss.backward()
    return loss.item(), logprob.grad.item(), metrics


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "has_grad", "clipped"),
    [
        # A > 0: only the upper bound 1 + 0.28 clips.
        (1.0, 1.0, -1.0, True, None),
        (1.28, 1.0, -1.28, True, None),  # exactly at the bound: not yet clipped
        (1.5, 1.0, -1.28, False, "high"),  # beyond: constant, no gradient
        (0.5, 1.0, -0.5, True, None),  # below 1 - 0.2 with A > 0: the unclipped term wins
        # A < 0: only the lower bound 1 - 0.2 clips.
        (0.8, -1.0, 0.8, True, None),  # exactly at the bound
        (0.5, -1.0, 0.8, False, "low"),  # beyond: constant 0.8, no gradient
        (1.5, -1.0, 1.5, True, None),  # above 1 + 0.28 with A < 0: the unclipped term wins
    ],
)
def test_clipped_loss_at_and_beyond_both_bounds(ratio, adv, loss, has_grad, clipped):
    value, grad, metrics = _loss_per_token(ratio, adv)
    assert value == pytest.approx(loss, abs=1e-6)
    assert (abs(grad) > 1e-8) == has_grad
    assert metrics["clip_frac_high"] == (1.0 if clipped == "high" else 0.0)
    assert metrics["clip_frac_low"] == (1.0 if clipped == "low" else 0.0)


def test_loss_is_a_token_mean_over_unmasked_tokens():
    # Two responses: 3 tokens with A=+1, 1 token with A=-1 (and 2 padding tokens).
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = clipped_policy_loss(logprobs, logprobs, torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx((-1 - 1 - 1 + 1) / 4)
    # With an explicit denominator (micro-batching) the sum is divided by it instead.
    loss, _ = clipped_policy_loss(logprobs, logprobs, torch.tensor([1.0, -1.0]), mask, token_denom=8.0)
    assert loss.item() == pytest.approx(-2 / 8)


def test_micro_batch_losses_sum_to_the_full_batch_loss():
    torch.manual_seed(0)
    lp, old = torch.randn(6, 5) * 0.1, torch.randn(6, 5) * 0.1
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    full, _ = clipped_policy_loss(lp, old, adv, mask)
    denom = float(mask.sum())
    parts = [
        clipped_policy_loss(
            lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], token_denom=denom
        )[0]
        for i in (0, 2, 4)
    ]
    torch.testing.assert_close(sum(parts), full)


def test_kl_estimators_by_hand():
    # log-ratio x = log pi - log ref = log 2.
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    x = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(x)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(x * x / 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + x)


def test_k3_is_non_negative_and_zero_only_at_equality():
    torch.manual_seed(0)
    lp, ref = torch.randn(100, 7) * 3, torch.randn(100, 7) * 3
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert kl_estimate(lp, lp, "k3").abs().max().item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_masked_mean_ignores_padding_and_survives_an_empty_mask():
    v = torch.tensor([[2.0, 100.0]])
    assert masked_mean(v, torch.tensor([[1.0, 0.0]])).item() == 2.0
    assert masked_mean(v, torch.zeros(1, 2)).item() == 0.0


def test_dropped_responses_leave_their_group_statistics():
    # Group [1, 0, 0, X] with X dropped is the group [1, 0, 0]: mean 1/3, std sqrt(1/3).
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    adv = group_advantages(rewards, 4, eps=0.0, valid=valid)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0]))
    # A group left with one valid response has no baseline.
    assert group_advantages(rewards, 4, valid=torch.tensor([True, False, False, False])).tolist() == [0.0] * 4
