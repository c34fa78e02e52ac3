"""The GRPO family (issue 6): advantage estimators, policy losses and aggregations, KL placement,
DAPO's pieces and truncated importance sampling, against hand-worked numbers and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.algos.advantages import ADVANTAGE_ESTIMATORS, clip_advantages, get_advantage_estimator
from mmrl.algos.dapo import informative_groups, overlong_penalty, truncation_mask
from mmrl.algos.kl import kl_estimate, kl_in_loss, kl_penalized_rewards
from mmrl.algos.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    clipped_policy_loss,
    get_policy_loss,
    loss_denominator,
)
from mmrl.algos.tis import tis_weights

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gdpo", "opo", "gpg"]
# Checked in tests/test_algos_rest.py: remax needs a greedy baseline, pass_at_k binary rewards;
# grpo_passk (G >= 2) in tests/test_fidelity_formulas.py.
OTHER_ESTIMATORS = ["remax", "pass_at_k", "grpo_passk"]
LOSSES = ["ppo", "gspo", "cispo", "cispo_seq", "gmpo", "sapo", "gpg"]
# Two prompts, G = 4: group 0 is [1, 0, 0, 0], group 1 is [1, 1, 0, 0].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


def adv(name: str, rewards: torch.Tensor, group_size: int, **kw) -> torch.Tensor:
    return get_advantage_estimator(name)(rewards, group_size, **kw)


# ---------------------------------------------------------------------------------------------
# Advantage estimators


def test_every_estimator_is_registered_by_name():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(ESTIMATORS + OTHER_ESTIMATORS)


def test_dr_grpo_by_hand():
    # Group means 0.25 and 0.5; no division by the std.
    expected = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    torch.testing.assert_close(adv("dr_grpo", REWARDS, 4), torch.tensor(expected))


def test_rloo_by_hand():
    # Group 0: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    # Group 1: 1 - mean(1, 0, 0) = 2/3; 0 - mean(1, 1, 0) = -2/3.
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3]
    torch.testing.assert_close(adv("rloo", REWARDS, 4), torch.tensor(expected))


def test_reinforce_pp_by_hand():
    # Batch mean 3/8; deviations 5/8 (x3) and -3/8 (x5); sum of squares 3 * 25/64 + 5 * 9/64 = 1.875;
    # unbiased std sqrt(1.875 / 7).
    s = math.sqrt(1.875 / 7)
    expected = [0.625 / s if r else -0.375 / s for r in REWARDS.tolist()]
    torch.testing.assert_close(adv("reinforce_pp", REWARDS, 4, eps=0.0), torch.tensor(expected))


def test_reinforce_pp_baseline_by_hand():
    # Minus the group means: [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]; batch mean 0,
    # sum of squares 0.5625 + 3 * 0.0625 + 4 * 0.25 = 1.75, unbiased std sqrt(1.75 / 7) = 0.5.
    expected = [1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0]
    torch.testing.assert_close(adv("reinforce_pp_baseline", REWARDS, 4, eps=0.0), torch.tensor(expected))


def test_gdpo_by_hand():
    # G = 2, two components. Prompt 0: (1, 0), (0, 1); prompt 1: (1, 1), (1, 0).
    # Component 0, per group: [1, 0] -> [a, -a] with a = 0.5 / sqrt(0.5) = 1/sqrt(2); [1, 1] -> [0, 0].
    # Component 1, per group: [0, 1] -> [-a, a]; [1, 0] -> [a, -a].
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    a = 1 / math.sqrt(2)
    # Sum: [0, 0, a, -a]; batch mean 0, unbiased std sqrt(2 a^2 / 3) = sqrt(1/3).
    got = adv("gdpo", rewards, 2, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, a * math.sqrt(3), -a * math.sqrt(3)]))
    # Weights (2, 1): [2a - a, -2a + a, a, -a] = [a, -a, a, -a]; std sqrt(4 a^2 / 3) = sqrt(2/3).
    got = adv("gdpo", rewards, 2, eps=0.0, weights=[2.0, 1.0])
    h = math.sqrt(3) / 2  # a / sqrt(2/3)
    torch.testing.assert_close(got, torch.tensor([h, -h, h, -h]))
    with pytest.raises(ValueError, match="gdpo: 3 weights for 2 reward components"):
        adv("gdpo", rewards, 2, weights=[1.0, 1.0, 1.0])


def test_gdpo_keeps_reward_combinations_apart_that_grpo_on_the_sum_merges():
    # GDPO's motivating case, G = 2 and two binary rewards. Prompt 0: (0, 0) and (1, 0), sums
    # [0, 1]; prompt 1: (0, 0) and (1, 1), sums [0, 2]. GRPO on the sums gives both groups
    # [-a, a] (a = 1/sqrt(2)). GDPO: prompt 0 -> [-a, a] + [0, 0]; prompt 1 -> [-a, a] + [-a, a]
    # = [-2a, 2a]; batch normalisation rescales all four alike, so prompt 1's are twice prompt 0's.
    comps = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    grpo = adv("grpo", comps.sum(dim=1), 2)
    torch.testing.assert_close(grpo[:2], grpo[2:])
    gdpo = adv("gdpo", comps, 2)
    torch.testing.assert_close(gdpo[2:], 2 * gdpo[:2])
    # A single component is GRPO followed by batch normalisation; with one group that is GRPO
    # itself (its advantages already have unit std).
    one = torch.tensor([1.0, 0.0, 0.0, 2.0])
    torch.testing.assert_close(adv("gdpo", one, 4), adv("grpo", one, 4), atol=1e-5, rtol=1e-5)


def test_dropped_rows_leave_the_statistics_of_every_estimator():
    # Group [1, 0, 0, X] with X dropped (and NaN: never read).
    rewards = torch.tensor([1.0, 0.0, 0.0, float("nan")])
    valid = torch.tensor([True, True, True, False])
    # RLOO over [1, 0, 0]: 1 - 0 = 1, 0 - mean(1, 0) = -0.5.
    torch.testing.assert_close(adv("rloo", rewards, 4, valid=valid), torch.tensor([1.0, -0.5, -0.5, 0.0]))
    # Dr.GRPO: mean 1/3.
    torch.testing.assert_close(
        adv("dr_grpo", rewards, 4, valid=valid), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0])
    )
    # REINFORCE++ over the batch [1, 0, 0]: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3.
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(
        adv("reinforce_pp", rewards, 2, eps=0.0, valid=valid),
        torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0]),
    )
    for name in ESTIMATORS:
        got = adv(name, rewards, 4, valid=valid)
        assert torch.isfinite(got).all() and got[3] == 0.0, name


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_degenerate_batches_give_zero_advantages_and_never_nan(name, eps):
    # All rewards equal (groups and batch have zero std), with eps = 0 too.
    for value in (0.7, 0.0, 3.0):
        assert adv(name, torch.full((6,), value), 3, eps=eps).tolist() == [0.0] * 6
    # Every row invalid.
    none = torch.zeros(6, dtype=torch.bool)
    assert adv(name, torch.arange(6.0), 3, eps=eps, valid=none).tolist() == [0.0] * 6
    # An empty batch.
    assert adv(name, torch.zeros(0), 3, eps=eps).shape == (0,)
    # Groups each constant but different from one another: zero within-group spread.
    const_groups = torch.tensor([1.0, 1.0, 0.0, 0.0])
    expected_nonzero = name == "reinforce_pp"  # the only estimator without a group baseline
    got = adv(name, const_groups, 2, eps=eps)
    assert torch.isfinite(got).all()
    assert bool((got != 0).any()) == expected_nonzero


@pytest.mark.parametrize("name", ESTIMATORS)
def test_single_sample_groups(name):
    # G = 1: no group baseline, so every group-baselined estimator gives 0; REINFORCE++ has only
    # the batch baseline: [1, 0] -> mean 0.5, unbiased std sqrt(0.5), A = +-0.5 / sqrt(0.5).
    # REINFORCE++-baseline follows veRL: a one-response group's baseline is 0, so it whitens the
    # raw rewards like REINFORCE++ (veRL adds 1e-8 to the variance).
    got = adv(name, torch.tensor([1.0, 0.0]), 1, eps=0.0)
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        torch.testing.assert_close(got, torch.tensor([math.sqrt(0.5), -math.sqrt(0.5)]))
    else:
        assert got.tolist() == [0.0, 0.0]


def test_estimator_inputs_are_checked():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        adv("rloo", torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"rewards must be \[N\], got shape \[4, 2\]"):
        adv("dr_grpo", torch.zeros(4, 2), 2)
    with pytest.raises(ValueError, match=r"valid must be \[N\] = \[4\]"):
        adv("reinforce_pp", torch.zeros(4), 2, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"non-finite reward at rows \[1\]"):
        adv("grpo", torch.tensor([0.0, float("inf"), 1.0, 0.0]), 2)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        adv("grpo", torch.zeros(4), 0)


def test_clip_advantages():
    a = torch.tensor([-5.0, -1.0, 0.5, 7.0])
    assert clip_advantages(a, 2.0).tolist() == [-2.0, -1.0, 0.5, 2.0]
    assert clip_advantages(a, None) is a
    with pytest.raises(ValueError, match="max_abs must be > 0"):
        clip_advantages(a, 0.0)


# ---------------------------------------------------------------------------------------------
# Aggregation

# Row 0: 3 tokens (1, 2, 3); row 1: 1 token (4) and padding 100; row 2: fully masked, all NaN.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [float("nan")] * 3])
AGG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("agg", "max_len", "value", "denom"),
    [
        ("token_mean", None, (1 + 2 + 3 + 4) / 4, 4.0),  # tokens
        ("seq_mean_token_mean", None, (6 / 3 + 4 / 1) / 2, 2.0),  # non-empty sequences
        ("seq_mean_token_sum_norm", 4, (6 / 4 + 4 / 4) / 2, 2.0 * 4),  # sequences x max_len
        ("seq_mean_token_sum_norm", None, (6 / 3 + 4 / 3) / 2, 2.0 * 3),  # max_len defaults to R
    ],
)
def test_aggregations_by_hand(agg, max_len, value, denom):
    assert aggregate(PER_TOKEN, AGG_MASK, agg, max_len=max_len).item() == pytest.approx(value)
    assert loss_denominator(AGG_MASK, agg, max_len) == denom


def test_aggregation_edge_cases():
    empty = torch.zeros(2, 3)
    for agg in AGGREGATIONS:
        assert aggregate(torch.full((2, 3), float("nan")), empty, agg).item() == 0.0
        assert loss_denominator(empty, agg, 5) >= 1
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq_sum'"):
        aggregate(PER_TOKEN, AGG_MASK, "seq_sum")
    with pytest.raises(ValueError, match="max_len must be > 0"):
        loss_denominator(AGG_MASK, "seq_mean_token_sum_norm", 0)


# ---------------------------------------------------------------------------------------------
# Policy losses


def one_token(name: str, ratio: float, advantage: float, **kw):
    """Loss, d loss / d logprob and metrics of a single token with the given ratio."""
    logprob = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(ratio)]])
    loss, metrics = get_policy_loss(name)(logprob, old, torch.tensor([advantage]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logprob.grad.item(), metrics


def test_every_loss_is_registered_by_name():
    # clip_cov / kl_cov (tests/test_stability.py) select tokens by statistics of the call's own
    # tokens, so the micro-batch property below does not hold for them.
    assert sorted(POLICY_LOSSES) == sorted([*LOSSES, "clip_cov", "kl_cov"])
    with pytest.raises(ValueError, match="unknown policy loss 'ppg'"):
        get_policy_loss("ppg")


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "dual"),
    [
        # clip_low 0.2, clip_high 0.28, clip_dual 3.
        (2.0, -1.0, 2.0, 2.0, 0.0),  # A < 0, ratio below c: unclipped -A r, d/dlp = -A r = 2
        (5.0, -1.0, 3.0, 0.0, 1.0),  # max(5, 0.8) = 5 capped at -A c = 3, constant
        (math.exp(15), -2.0, 6.0, 0.0, 1.0),  # a huge ratio: still -A c = 6
        (5.0, 1.0, -1.28, 0.0, 0.0),  # A > 0 is not dual-clipped: -A (1 + 0.28)
    ],
)
def test_dual_clip_caps_negative_advantage_losses(ratio, advantage, loss, grad, dual):
    value, g, metrics = one_token("ppo", ratio, advantage, clip_low=0.2, clip_high=0.28, clip_dual=3.0)
    assert value == pytest.approx(loss, rel=1e-5)
    assert g == pytest.approx(grad, rel=1e-5, abs=1e-8)
    assert metrics["clip_frac_dual"] == dual
    # Without dual-clip the huge-ratio loss is unbounded: -A r.
    value, _, metrics = one_token("ppo", ratio, advantage, clip_low=0.2, clip_high=0.28)
    assert value == pytest.approx(max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.28)), rel=1e-5)
    assert metrics["clip_frac_dual"] == 0.0


def test_gspo_by_hand():
    # Row 0: token log-ratios (0.3, -0.1, 0.1), mean 0.1 -> s0 = e^0.1 = 1.105, inside [0.8, 1.2].
    # Row 1: (0.6, 0.4) and a padded position; mean 0.5 -> s1 = e^0.5 = 1.649 > 1.2: the whole
    # response is clipped (A > 0), although token 1's own ratio e^0.4 = 1.49 is what PPO would see.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, 0.0]])
    lr = torch.tensor([[0.3, -0.1, 0.1], [0.6, 0.4, 50.0]])
    logprobs = (old + lr).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0, 1.0])
    s0, s1 = math.exp(0.1), math.exp(0.5)
    loss, metrics = get_policy_loss("gspo")(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    # token_mean: (3 * (-s0) + 2 * (-1.2)) / 5.
    assert loss.item() == pytest.approx((-3 * s0 - 2 * 1.2) / 5, rel=1e-6)
    loss.backward()
    # Row 0's tokens each get -A s0 / 5; row 1 is clipped (constant): no gradient, nor on padding.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s0 / 5] * 3, [0.0, 0.0, 0.0]]))
    assert metrics["clip_frac_high"] == pytest.approx(2 / 5)  # row 1's two tokens
    assert metrics["ratio_mean"] == pytest.approx((3 * s0 + 2 * s1) / 5, rel=1e-6)
    assert (metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx((s0, s1), rel=1e-6)
    # The paper's sequence-mean aggregation: (-s0 + -1.2) / 2.
    loss, _ = get_policy_loss("gspo")(
        logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.2, agg="seq_mean_token_mean"
    )
    assert loss.item() == pytest.approx((-s0 - 1.2) / 2, rel=1e-6)


def test_cispo_by_hand():
    # One response, A = 1, ratios (1, 2, 0.5), log-probs (-1, -2, -0.5), clip_low 0.2,
    # clip_high 0.28: clipped weights (1, 1.28, 0.8).
    # Per-token loss -w A logp = (1, 2.56, 0.4); token mean 3.96 / 3 = 1.32.
    # Gradient -w A / 3 per token: every token learns, the one beyond the bound included.
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.log(torch.tensor([[1.0, 2.0, 0.5]]))
    loss, metrics = get_policy_loss("cispo")(
        lp, old, torch.tensor([1.0]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28
    )
    assert loss.item() == pytest.approx(1.32, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.28, -0.8]]) / 3)
    # CISPO counts clipped weights whatever the sign of A.
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_dual"] == 0.0
    with pytest.raises(ValueError, match="cispo: dual-clip does not apply"):
        get_policy_loss("cispo")(
            lp, old, torch.tensor([1.0]), torch.ones(1, 3), clip_low=0.2, clip_high=0.2, clip_dual=3.0
        )


def test_cispo_keeps_the_gradient_ppo_drops_beyond_the_clip_bound():
    # Ratio 2 with A = 1, clip_high 0.28: PPO's loss is the constant -1.28 (zero gradient);
    # CISPO's gradient is -clip(2) A = -1.28.
    _, ppo_grad, ppo_metrics = one_token("ppo", 2.0, 1.0, clip_low=0.2, clip_high=0.28)
    _, cispo_grad, _ = one_token("cispo", 2.0, 1.0, clip_low=0.2, clip_high=0.28)
    assert ppo_grad == 0.0 and ppo_metrics["clip_frac_high"] == 1.0
    assert cispo_grad == pytest.approx(-1.28)


def test_per_token_weights_multiply_the_per_token_loss():
    # On-policy, A = 1, two tokens: PPO's per-token loss is -1; weights (0.5, 2) -> (-0.5 - 2) / 2.
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = get_policy_loss("ppo")(
        lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2, weights=w
    )
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, -w / 2)  # d(-w r)/d lp = -w r, r = 1, over 2 tokens


def random_batch(seed: int, n: int = 6, r: int = 5, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, r, generator=g) * 3
    lp = old + torch.randn(n, r, generator=g) * scale
    advantages = torch.randn(n, generator=g)
    mask = (torch.rand(n, r, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    mask[2] = 0.0  # a fully masked row
    return lp, old, advantages, mask


LOSS_KW = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.28, "clip_dual": 3.0},
    "gspo": {"clip_low": 0.05, "clip_high": 0.08, "clip_dual": 3.0},
    "cispo": {"clip_low": 0.2, "clip_high": 0.28},
    "cispo_seq": {"clip_low": 0.05, "clip_high": 0.08},
    "gmpo": {"clip_low": 0.4, "clip_high": 0.4},
    "sapo": {"clip_low": 0.2, "clip_high": 0.28, "tau_pos": 1.0, "tau_neg": 1.05},
    "gpg": {"clip_low": 0.2, "clip_high": 0.28},
}


@pytest.mark.parametrize("name", LOSSES)
def test_on_policy_every_loss_has_ratio_one_and_nothing_clipped(name):
    _, old, advantages, mask = random_batch(0)
    lp = old.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(lp, old, advantages, mask, **LOSS_KW[name])
    assert metrics["ratio_mean"] == metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == metrics["clip_frac_dual"] == 0.0
    loss.backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batch_losses_sum_to_the_mini_batch_loss(name, agg):
    lp, old, advantages, mask = random_batch(1)
    fn = get_policy_loss(name)
    full_lp = lp.clone().requires_grad_()
    full, _ = fn(full_lp, old, advantages, mask, agg=agg, max_len=8, **LOSS_KW[name])
    full.backward()
    denom = loss_denominator(mask, agg, max_len=8)
    micro_lp = lp.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # the middle one is the fully masked row
        part, _ = fn(
            micro_lp[rows], old[rows], advantages[rows], mask[rows], agg=agg, denom=denom, **LOSS_KW[name]
        )
        part.backward()
        total = total + part
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_fully_masked_rows_contribute_nothing_and_never_nan(name, agg):
    lp, old, advantages, mask = random_batch(2)
    garbage_lp, garbage_old = lp.clone(), old.clone()
    garbage_lp[2] = float("-inf")
    garbage_old[2] = float("nan")
    garbage_lp[3, mask[3] == 0] = float("inf")  # padding of a live row too
    fn = get_policy_loss(name)
    x = garbage_lp.requires_grad_()
    loss, metrics = fn(x, garbage_old, advantages, mask, agg=agg, **LOSS_KW[name])
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert (x.grad[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())
    keep = [0, 1, 3, 4, 5]
    clean, _ = fn(lp[keep], old[keep], advantages[keep], mask[keep], agg=agg, **LOSS_KW[name])
    torch.testing.assert_close(loss, clean)
    # A batch with no token at all: loss 0, neutral metrics.
    loss, metrics = fn(x, garbage_old, advantages, torch.zeros_like(mask), agg=agg, **LOSS_KW[name])
    assert loss.item() == 0.0 and metrics["ratio_mean"] == 1.0 and metrics["clip_frac_high"] == 0.0


@pytest.mark.parametrize("padded", [False, True])
def test_gspo_equals_ppo_when_every_response_has_one_token(padded):
    g = torch.Generator().manual_seed(3)
    n = 16
    old = -torch.rand(n, 1, generator=g) * 3
    lp = old + torch.randn(n, 1, generator=g) * 0.8  # ratios on both sides of every bound
    advantages = torch.randn(n, generator=g)
    mask = torch.ones(n, 1)
    if padded:  # one real token at a different position in each row of a 4-wide batch
        mask = torch.nn.functional.one_hot(torch.arange(n) % 4, 4).float()
        lp = torch.where(mask > 0, lp, -3.0)  # padding: garbage log-ratio -10
        old = torch.where(mask > 0, old, 7.0)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "clip_dual": 3.0}
    results = []
    for name in ("ppo", "gspo"):
        x = lp.clone().requires_grad_()
        loss, metrics = get_policy_loss(name)(x, old, advantages, mask, **kw)
        loss.backward()
        results.append((loss, x.grad, metrics))
    (ppo, ppo_grad, ppo_m), (gspo, gspo_grad, gspo_m) = results
    torch.testing.assert_close(gspo, ppo)
    torch.testing.assert_close(gspo_grad, ppo_grad)
    assert gspo_m == pytest.approx(ppo_m)
    assert ppo_m["clip_frac_high"] > 0 and ppo_m["clip_frac_low"] > 0  # the bounds were exercised


def test_clipped_policy_loss_is_ppo_with_token_mean():
    lp, old, advantages, mask = random_batch(4)
    a = clipped_policy_loss(lp, old, advantages, mask, 0.2, 0.28, token_denom=40.0)
    b = get_policy_loss("ppo")(lp, old, advantages, mask, clip_low=0.2, clip_high=0.28, denom=40.0)
    torch.testing.assert_close(a[0], b[0])
    assert a[1] == b[1]


def test_loss_inputs_are_checked():
    lp, old, advantages, mask = random_batch(5)
    ppo = get_policy_loss("ppo")
    with pytest.raises(ValueError, match=r"ppo: mask has shape \[6, 4\], logprobs has \[6, 5\]"):
        ppo(lp, old, advantages, mask[:, :4], clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match=r"gspo: advantages must be \[N\] = \[6\]"):
        get_policy_loss("gspo")(lp, old, advantages[:3], mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_dual must be > 1"):
        ppo(lp, old, advantages, mask, clip_low=0.2, clip_high=0.2, clip_dual=0.5)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        ppo(lp, old, advantages, mask, clip_low=0.2, clip_high=0.2, agg="mean")


# ---------------------------------------------------------------------------------------------
# KL


def test_kl_penalized_rewards_by_hand():
    # Row 0: r = 1, kl (0.1, 0.2) and a padded NaN: 1 - 0.5 * 0.3 = 0.85.
    # Row 1: r = 0.5, kl (0.3, -0.1, 0.05): 0.5 - 0.5 * 0.25 = 0.375.
    # Row 2: fully masked: keeps r = -1.
    kl = torch.tensor([[0.1, 0.2, float("nan")], [0.3, -0.1, 0.05], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = kl_penalized_rewards(torch.tensor([1.0, 0.5, -1.0]), kl, mask, beta=0.5)
    torch.testing.assert_close(got, torch.tensor([0.85, 0.375, -1.0]))
    with pytest.raises(ValueError, match="beta must be >= 0"):
        kl_penalized_rewards(torch.zeros(3), kl, mask, beta=-1.0)
    with pytest.raises(ValueError, match=r"rewards must be \[N\] = \[3\]"):
        kl_penalized_rewards(torch.zeros(2), kl, mask, beta=0.1)


def test_kl_in_loss_by_hand():
    # Tokens with log-ratios ln 2 and 0 (and a padded -inf): k3 = (0.5 - 1 + ln 2, 0).
    lp = torch.tensor([[math.log(0.5), math.log(0.3), float("-inf")]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.3), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k3 = 0.5 - 1 + math.log(2)
    got = kl_in_loss(lp, ref, mask, estimator="k3")
    assert got.item() == pytest.approx(k3 / 2)
    got.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0.0
    # Same aggregations as the policy loss: with max_len 4, sum / (1 sequence x 4).
    assert kl_in_loss(lp, ref, mask, agg="seq_mean_token_sum_norm", max_len=4).item() == pytest.approx(k3 / 4)


@pytest.mark.parametrize(("estimator", "target"), [("k2", "reverse"), ("k3", "forward")])
def test_kl_in_the_loss_has_the_documented_expected_gradient(estimator, target):
    # Exact expectation over a 4-way categorical pi = softmax(theta): sum_a pi(a) grad k(a)
    # equals grad KL(pi || ref) for k2 and grad KL(ref || pi) for k3 (kl.py's docstring).
    theta = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.2, 0.4], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    expected_grad = (logp.exp().detach() * kl_estimate(logp, ref, estimator)).sum()
    (g,) = torch.autograd.grad(expected_grad, theta)
    logp = torch.log_softmax(theta, -1)
    if target == "reverse":
        kl = (logp.exp() * (logp - ref)).sum()
    else:
        kl = (ref.exp() * (ref - logp)).sum()
    (want,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(g, want)
    # k1's expected gradient is zero.
    logp = torch.log_softmax(theta, -1)
    (g1,) = torch.autograd.grad((logp.exp().detach() * kl_estimate(logp, ref, "k1")).sum(), theta)
    torch.testing.assert_close(g1, torch.zeros_like(g1))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-60, 60), min_size=1, max_size=20),
    st.lists(st.floats(-60, 60), min_size=1, max_size=20),
)
def test_k3_is_never_negative(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor([a[:n]]), torch.tensor([b[:n]])
    k3 = kl_estimate(lp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()


# ---------------------------------------------------------------------------------------------
# DAPO


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 4: free up to 16, then -(L - 16) / 4, -1 beyond 20.
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 40])
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4), torch.tensor(expected))
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, factor=0.5), torch.tensor(expected) * 0.5)
    # No buffer: a hard step after max_len.
    assert overlong_penalty(torch.tensor([20, 21]), 20, 0).tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="overlong buffer must be in"):
        overlong_penalty(lengths, 20, 30)


def test_informative_groups_by_hand():
    # G = 2: [1, 1] no, [0, 1] yes, [0, 0] no, [0.5, 0.5] no.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
    # Only valid rows are compared: [0, X] leaves one row, no signal.
    valid = torch.tensor([True, True, True, False, True, True, True, True])
    assert informative_groups(rewards, 2, valid=valid).tolist() == [False, False, False, False]
    # Reward components: the sums are equal (1, 1) but the components differ -> informative.
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert informative_groups(comps, 2).tolist() == [True, False]
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        informative_groups(torch.zeros(6), 4)


def test_truncation_mask():
    assert truncation_mask(torch.tensor([True, False, True])).tolist() == [0.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Truncated importance sampling

# Per-token ratios pi_trainer / pi_rollout: row 0 (0.5, 1.5, 3), row 1 (4, 1) and a padded
# position holding garbage, row 2 (0.5, 2) and padding.
TIS_RATIOS = torch.tensor([[0.5, 1.5, 3.0], [4.0, 1.0, 1.0], [0.5, 2.0, 1.0]])
TIS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def tis_inputs():
    rollout = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -1.1, -5.0], [-2.0, -1.0, -4.0]])
    trainer = rollout + TIS_RATIOS.log()
    trainer[1, 2] = float("nan")
    return trainer, rollout


def test_token_level_tis_by_hand():
    trainer, rollout = tis_inputs()
    w, m = tis_weights(trainer, rollout, TIS_MASK, level="token", cap=2.0, mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0], [2.0, 1.0, 0.0], [0.5, 2.0, 0.0]]))
    # Raw weights over the 7 tokens: 0.5 + 1.5 + 3 + 4 + 1 + 0.5 + 2 = 12.5.
    assert m["tis/weight_mean"] == pytest.approx(12.5 / 7)
    assert m["tis/weight_max"] == pytest.approx(4.0) and m["tis/weight_min"] == pytest.approx(0.5)
    assert m["tis/applied_weight_mean"] == pytest.approx(9.5 / 7)
    assert m["tis/truncated_frac"] == pytest.approx(2 / 7)  # 3 and 4 (2 is at the cap, kept)
    # Mask mode: weights above the cap become 0.
    w, m = tis_weights(trainer, rollout, TIS_MASK, level="token", cap=2.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 0.0], [0.0, 1.0, 0.0], [0.5, 2.0, 0.0]]))
    assert m["tis/masked_frac"] == pytest.approx(2 / 7) and "tis/truncated_frac" not in m
    # Rollout-vs-trainer KL, tokens sampled by the rollout: x = log rollout - log trainer = -ln w.
    # k1 = mean(-ln w) = -ln(0.5 * 1.5 * 3 * 4 * 1 * 0.5 * 2) / 7 = -ln 9 / 7;
    # k3 = mean(e^{-x} - 1 + x) = mean(w - 1 - ln w).
    ratios = [0.5, 1.5, 3.0, 4.0, 1.0, 0.5, 2.0]
    assert m["rollout/kl_k1"] == pytest.approx(-math.log(9) / 7, rel=1e-5)
    assert m["rollout/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 7, rel=1e-5)


def test_sequence_level_tis_by_hand():
    trainer, rollout = tis_inputs()
    # Products: row 0 0.5 * 1.5 * 3 = 2.25, row 1 4 * 1 = 4, row 2 0.5 * 2 = 1; cap 2.
    w, m = tis_weights(trainer, rollout, TIS_MASK, level="sequence", cap=2.0, mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["tis/truncated_frac"] == pytest.approx(5 / 7)  # rows 0 and 1, token-weighted
    assert m["tis/weight_max"] == pytest.approx(4.0)
    assert m["tis/weight_mean"] == pytest.approx((3 * 2.25 + 2 * 4 + 2 * 1) / 7)
    w, m = tis_weights(trainer, rollout, TIS_MASK, level="sequence", cap=2.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["tis/masked_frac"] == pytest.approx(5 / 7)


def test_tis_survives_an_enormous_sequence_ratio_and_checks_its_arguments():
    trainer, rollout = torch.zeros(1, 100), torch.full((1, 100), -5.0)  # product e^500
    w, m = tis_weights(trainer, rollout, torch.ones(1, 100), level="sequence", cap=3.0)
    assert (w == 3.0).all() and math.isfinite(m["tis/weight_max"])
    with pytest.raises(ValueError, match="unknown TIS level 'batch'"):
        tis_weights(trainer, rollout, torch.ones(1, 100), level="batch")
    with pytest.raises(ValueError, match="unknown TIS mode 'clip'"):
        tis_weights(trainer, rollout, torch.ones(1, 100), mode="clip")
    with pytest.raises(ValueError, match="TIS cap must be > 0"):
        tis_weights(trainer, rollout, torch.ones(1, 100), cap=0.0)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.01, 30.0),
    cap=st.floats(0.1, 10.0),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["truncate", "mask"]),
)
def test_tis_weights_never_exceed_their_cap(seed, scale, cap, level, mode):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 6, generator=g) * 5
    trainer = (rollout + torch.randn(4, 6, generator=g) * scale).requires_grad_()
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    w, metrics = tis_weights(trainer, rollout, mask, level=level, cap=cap, mode=mode)
    assert not w.requires_grad
    assert torch.isfinite(w).all() and (w >= 0).all() and (w <= cap).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_tis_weights_plug_into_every_loss():
    lp, old, advantages, mask = random_batch(6)
    w, _ = tis_weights(old, old - 0.1, mask, cap=2.0)  # ratio e^0.1 everywhere
    for name in LOSSES:
        base, _ = get_policy_loss(name)(lp, old, advantages, mask, **LOSS_KW[name])
        weighted, _ = get_policy_loss(name)(lp, old, advantages, mask, weights=w, **LOSS_KW[name])
        torch.testing.assert_close(weighted, base * math.exp(0.1))
