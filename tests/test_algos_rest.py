"""The rest of the GRPO family (issue 19, part 5) and demonstrations (part 6): ReMax, OPO, GPG
and pass@k advantages; GMPO, SAPO, GPG and sequence-level CISPO losses; the straight-through,
abs and exact (full-vocabulary) KL; the off-policy sequence mask; GDPO's batch-norm option and
missing components; the demonstration term. Hand-worked values and gradients, edge cases, the
trainer's plumbing on a tiny model, config checks.

Checked against the reference code itself in a scratch environment outside the repo (a venv in
/tmp with veRL volcengine/verl at b178a3cd (2026-01-29) on the path, imported as is, and TRL
1.16.0): on 50 seeded random batches (6 prompts x 4 responses, 1-10 tokens, binary rewards,
normal advantages, log-ratios ~ N(0, 0.3)) mmrl's and veRL's functions gave, as max
|difference|: `compute_remax_outcome_advantage` 0, `compute_opo_outcome_advantage` 0,
`compute_gpg_outcome_advantage` 6e-8 after dividing each by its own alpha (the alphas differ by
definition: the paper's B / (B - M) here, N / count_nonzero(rewards) in veRL),
`compute_policy_loss_geo_mean` (GMPO, loss 6e-8, gradient 6e-9, with seq_mean_token_mean),
`compute_policy_loss_sapo` 0 and 0, `compute_policy_loss_gpg` 0 and 0, sequence-level CISPO =
veRL's `compute_policy_loss_cispo` fed old log-probs lp - s_i (so every token's ratio is the
sequence ratio s_i): loss 9e-8, gradient 4e-9; `kl_penalty` k1 / k2 / abs 0, k3 5e-7 (value)
and 1e-6 (gradient); k1+ / k3+ against veRL's straight-through body (k2 - sg(k2) +
sg(kl_penalty_forward(k))) 0 for the gradient, 5e-7 for k3+'s value. veRL's own
`kl_penalty(..., "k3+")` raises NotImplementedError at that commit (its forward is asked for
"k3+", suffix included). The off-policy sequence mask equals TRL's
`GRPOTrainer.get_off_policy_mask` exactly (delta 0.05). The method, not the reference code, is
kept here.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from mmrl.algos.advantages import get_advantage_estimator
from mmrl.algos.demonstrations import demonstration_loss
from mmrl.algos.kl import KL_ESTIMATORS, kl_estimate, kl_in_loss
from mmrl.algos.logprobs import head_full_kl
from mmrl.algos.losses import get_policy_loss, loss_denominator
from mmrl.algos.stability import off_policy_sequence_mask
from mmrl.config import load_config


def adv(name: str, rewards, group_size: int, **kw) -> torch.Tensor:
    return get_advantage_estimator(name)(torch.as_tensor(rewards, dtype=torch.float32), group_size, **kw)


def close(a, b, **kw):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), **kw
    )


# ---------------------------------------------------------------------------------------------
# ReMax


def test_remax_by_hand_and_its_edge_cases():
    # Two prompts, G = 2; greedy rewards 1 and 0: A = r - b.
    base = torch.tensor([1.0, 1.0, 0.0, 0.0])
    close(adv("remax", [1.0, 0.0, 1.0, 1.0], 2, baselines=base), [0.0, -1.0, 1.0, 1.0])
    # G = 1 works (no group statistic): the paper's own setting.
    close(adv("remax", [1.0, 0.0], 1, baselines=torch.tensor([0.0, 1.0])), [1.0, -1.0])
    # A greedy response that could not be scored (NaN) and a dropped row both give 0.
    got = adv(
        "remax", [1.0, 0.0, 1.0, float("nan")], 2,
        baselines=torch.tensor([float("nan")] * 2 + [0.5] * 2), valid=torch.tensor([True, True, True, False]),
    )  # fmt: skip
    close(got, [0.0, 0.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="remax: needs `baselines`"):
        adv("remax", [1.0, 0.0], 2)
    with pytest.raises(ValueError, match=r"remax: baselines must be \[N\] = \[2\]"):
        adv("remax", [1.0, 0.0], 2, baselines=torch.zeros(1))


# ---------------------------------------------------------------------------------------------
# OPO


def test_opo_weighs_the_baseline_by_response_length():
    # Group [1, 0, 0] with lengths [2, 4, 2]: b = 2 * 1 / 8 = 0.25 (Dr.GRPO's mean would be 1/3).
    close(adv("opo", [1.0, 0.0, 0.0], 3, token_counts=torch.tensor([2, 4, 2])), [0.75, -0.25, -0.25])
    # Without lengths every row weighs 1: Dr.GRPO.
    close(adv("opo", [1.0, 0.0, 0.0], 3), adv("dr_grpo", [1.0, 0.0, 0.0], 3))
    # A dropped row leaves the baseline: b over rows 0, 1 = 2 / 6.
    got = adv(
        "opo",
        [1.0, 0.0, 5.0],
        3,
        token_counts=torch.tensor([2, 4, 100]),
        valid=torch.tensor([True, True, False]),
    )
    close(got, [2 / 3, -1 / 3, 0.0])
    # No spread, a single valid row, or no token at all: 0.
    assert adv("opo", [0.5, 0.5], 2, token_counts=torch.tensor([3, 1])).tolist() == [0.0, 0.0]
    assert adv("opo", [1.0, 0.0], 2, valid=torch.tensor([True, False])).tolist() == [0.0, 0.0]
    assert adv("opo", [1.0, 0.0], 2, token_counts=torch.tensor([0, 0])).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# GPG


def test_gpg_rescales_group_mean_advantages_by_the_informative_share():
    # Groups [1, 0] (spread) and [1, 1] (none): M = 2 of B = 4 rows carry no signal, alpha = 2.
    close(adv("gpg", [1.0, 0.0, 1.0, 1.0], 2), [1.0, -1.0, 0.0, 0.0])
    # (veRL's N / count_nonzero(rewards) would be 4 / 3 here: see the module docs.)
    # Every group informative: alpha = 1, Dr.GRPO.
    close(adv("gpg", [1.0, 0.0, 0.0, 2.0], 2), adv("dr_grpo", [1.0, 0.0, 0.0, 2.0], 2))
    # Dropped rows count in neither B nor M: [1, 0, X] and [1, 1, 1]: B = 5, M = 3, alpha = 5/2.
    got = adv(
        "gpg", [1.0, 0.0, 9.0, 1.0, 1.0, 1.0], 3, valid=torch.tensor([True, True, False, True, True, True])
    )
    close(got, [2.5 * 0.5, -2.5 * 0.5, 0.0, 0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# pass@k


def _brute_force_pass_at_k(group: list[float], k: int) -> list[float]:
    """Each response's mean over the k-subsets holding it of (pass@k - mean) / std, where the
    mean and (population) std are over all k-subsets: the quantity the closed form computes."""
    n = len(group)
    subsets = list(itertools.combinations(range(n), k))
    passed = {s: float(any(group[i] > 0 for i in s)) for s in subsets}
    mean = sum(passed.values()) / len(subsets)
    std = math.sqrt(mean * (1 - mean))
    return [
        sum(passed[s] - mean for s in subsets if i in s) / sum(i in s for s in subsets) / std
        for i in range(n)
    ]


def test_pass_at_k_by_hand():
    # G = 4, one right, k = 2: R = 1 - C(3,2)/C(4,2) = 1/2, s = 1/2; A+ = (1/2)/(1/2) = 1;
    # A- = (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = (1/2 - 2/3) * 2 = -1/3.
    close(adv("pass_at_k", [1.0, 0.0, 0.0, 0.0], 4, k=2, eps=0.0), [1.0, -1 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize(
    "group", [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0, 1, 0, 1, 1, 0]]
)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_equals_the_expectation_over_every_k_subset(group, k):
    got = adv("pass_at_k", [float(x) for x in group], len(group), k=k, eps=0.0)
    if 0 < sum(group) < len(group) and _comb_all_pass(group, k):
        assert got.tolist() == [0.0] * len(group)  # every k-subset passes: no signal
    else:
        close(got, _brute_force_pass_at_k([float(x) for x in group], k), atol=1e-5, rtol=1e-5)
    assert abs(float(got.sum())) < 1e-5  # a group's advantages sum to 0


def _comb_all_pass(group, k):
    return sum(1 for x in group if x == 0) < k  # fewer wrong responses than k: every subset passes


def test_pass_at_1_is_grpo_with_the_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    n = 4
    close(
        adv("pass_at_k", rewards, 4, k=1, eps=0.0), adv("grpo", rewards, 4, eps=0.0) * math.sqrt(n / (n - 1))
    )


def test_pass_at_k_edge_cases():
    # All right, all wrong, k = G (one subset: the whole group), too few valid rows: 0.
    for rewards, k in (([1.0] * 4, 2), ([0.0] * 4, 2), ([1.0, 0.0, 0.0, 0.0], 4)):
        assert adv("pass_at_k", rewards, 4, k=k).tolist() == [0.0] * 4
    few = torch.tensor([True, True, False, False])
    assert adv("pass_at_k", [1.0, 0.0, 0.0, 0.0], 4, k=3, valid=few).tolist() == [0.0] * 4
    # Dropped rows leave the group: [1, 0, X, 0] is [1, 0, 0] with k = 2.
    got = adv(
        "pass_at_k", [1.0, 0.0, 0.7, 0.0], 4, k=2, eps=0.0, valid=torch.tensor([True, True, False, True])
    )
    close(got[[0, 1, 3]], _brute_force_pass_at_k([1.0, 0.0, 0.0], 2), atol=1e-5, rtol=1e-5)
    assert got[2] == 0.0
    assert adv("pass_at_k", torch.zeros(0), 4, k=2).shape == (0,)
    with pytest.raises(ValueError, match=r"pass_at_k needs binary rewards .* rows \[1\]"):
        adv("pass_at_k", [1.0, 0.5, 0.0, 0.0], 4, k=2)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        adv("pass_at_k", [1.0, 0.0], 2, k=0)


# ---------------------------------------------------------------------------------------------
# GDPO: batch-norm option and missing components


def test_gdpo_batch_norm_options_by_hand():
    # Prompt 0: (1, 0), (0, 1); prompt 1: (1, 1), (1, 0). Per-component group normalisation with
    # a = 1/sqrt(2): sums S = [0, 0, a, -a] (see test_algos_family.test_gdpo_by_hand).
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    a = 1 / math.sqrt(2)
    close(adv("gdpo", comps, 2, eps=0.0, batch_norm="none"), [0.0, 0.0, a, -a])
    # S has batch mean 0 already, so scaling only equals centring and scaling here.
    close(adv("gdpo", comps, 2, eps=0.0, batch_norm="std"), adv("gdpo", comps, 2, eps=0.0))
    # A shifted batch mean (weights (1, 0) on component 0 of groups with unequal sizes of
    # signal): S = [b, -b, 0, 0] scaled by std sqrt(2 b^2 / 3) = b sqrt(2/3).
    close(
        adv("gdpo", comps, 2, eps=0.0, batch_norm="std", weights=[1.0, 0.0]),
        [math.sqrt(1.5), -math.sqrt(1.5), 0, 0],
    )
    with pytest.raises(ValueError, match="unknown batch_norm"):
        adv("gdpo", comps, 2, batch_norm="group")


def test_gdpo_leaves_a_missing_component_out_of_that_components_statistics_only():
    nan = float("nan")
    # One prompt, G = 3. Component 0: [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3) ->
    # [c, -2c, c] with c = (1/3)/sqrt(1/3). Component 1: [0, NaN, 1]: statistics over rows 0
    # and 2 only, [0, 1] -> [-d, d] with d = 0.5 / sqrt(0.5); row 1 gets 0 from it.
    comps = torch.tensor([[1.0, 0.0], [0.0, nan], [1.0, 1.0]])
    c, d = (1 / 3) / math.sqrt(1 / 3), 0.5 / math.sqrt(0.5)
    close(adv("gdpo", comps, 3, eps=0.0, batch_norm="none"), [c - d, -2 * c, c + d])
    # TRL's normalize_then_sum gives the same sums (nanmean / nanstd per component, nansum).
    # A row missing every component is unscorable: 0, and out of the batch statistics.
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [nan, nan], [1.0, 1.0]])
    got = adv("gdpo", comps, 2, eps=0.0)
    assert got[2] == 0.0 and torch.isfinite(got).all()
    alone = adv("gdpo", comps[:2], 2, eps=0.0)  # the same prompt 0 without the second prompt
    close(got[:2], alone)  # prompt 1 has one scorable row: no signal, and no effect on the batch
    with pytest.raises(ValueError, match="non-finite reward"):
        adv("gdpo", torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), 2)


# ---------------------------------------------------------------------------------------------
# Policy losses


def _grad(name: str, lp: torch.Tensor, old: torch.Tensor, a: list[float], mask: torch.Tensor, **kw):
    x = lp.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(x, old, torch.tensor(a), mask, **kw)
    loss.backward()
    return loss.detach(), x.grad, metrics


def test_gmpo_by_hand():
    # Row 0, A = +1, log-ratios [0.1, 0.6, -0.2]: A > 0 caps each at clip_high = 0.4 (0.6 -> 0.4,
    # no gradient); rho = exp((0.1 + 0.4 - 0.2) / 3) = e^0.1. Row 1, A = -1, [0.1, 0.6, -0.6]:
    # A < 0 floors each at -clip_low = -0.4 (-0.6 -> -0.4, no gradient); rho = e^0.1 too.
    x = torch.tensor([[0.1, 0.6, -0.2], [0.1, 0.6, -0.6]])
    old = torch.full_like(x, -1.0)
    mask = torch.ones_like(x)
    kw = {"clip_low": 0.4, "clip_high": 0.4, "agg": "seq_mean_token_mean"}
    loss, grad, metrics = _grad("gmpo", old + x, old, [1.0, -1.0], mask, **kw)
    rho = math.exp(0.1)
    assert loss.item() == pytest.approx((-rho + rho) / 2, abs=1e-6)
    # d/dlp_t of (1/2)(-A_i rho_i) = -A_i rho_i / (2 * 3) on kept tokens.
    close(grad, [[-rho / 6, 0.0, -rho / 6], [rho / 6, rho / 6, 0.0]])
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6) and metrics["clip_frac_low"] == pytest.approx(
        1 / 6
    )
    assert metrics["ratio_mean"] == pytest.approx(rho)
    # On-policy: rho = 1 and the gradient is the policy gradient -A / (S |y_i|).
    _, grad, _ = _grad("gmpo", old, old, [2.0, -1.0], mask, **kw)
    close(grad, [[-2 / 6] * 3, [1 / 6] * 3])


def test_gmpo_ignores_padding_and_dampens_an_outlier_by_the_length_root():
    # One token far off (log-ratio 3, A < 0 so it is not capped): its share of rho is e^(3/L).
    old = torch.full((1, 4), -1.0)
    lp = old + torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    loss, _, _ = _grad("gmpo", lp, old, [-1.0], torch.ones(1, 4), clip_low=0.4, clip_high=0.4)
    assert loss.item() == pytest.approx(math.exp(3 / 4))
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    lp_pad = lp.clone()
    lp_pad[0, 2:] = float("nan")
    loss, grad, _ = _grad("gmpo", lp_pad, old, [-1.0], mask, clip_low=0.4, clip_high=0.4)
    assert loss.item() == pytest.approx(math.exp(3 / 2)) and (grad[0, 2:] == 0).all()


def test_sapo_by_hand():
    # A = +1 (tau 1) at ratios [1, 2, 0.5]: gate f(r) = 4 sigmoid(r - 1) -> [2, 4 s(1), 4 s(-0.5)];
    # d f / d log pi = 4 r s(u) (1 - s(u)), u = r - 1. Token mean over 3.
    r = torch.tensor([[1.0, 2.0, 0.5]])
    old = torch.full_like(r, -2.0)
    mask = torch.ones_like(r)
    loss, grad, _ = _grad("sapo", old + r.log(), old, [1.0], mask, clip_low=0.2, clip_high=0.28)
    s = torch.sigmoid
    gate = torch.tensor([2.0, 4 * s(torch.tensor(1.0)), 4 * s(torch.tensor(-0.5))])
    assert loss.item() == pytest.approx(-float(gate.mean()), rel=1e-6)
    u = r - 1
    close(grad, -(4 * r * s(u) * (1 - s(u))) / 3)
    # At r = 1 the gradient is exactly PPO's, -A / n, for either temperature; A < 0 uses tau_neg.
    loss, grad, _ = _grad("sapo", old, old, [-1.0], mask, clip_low=0.2, clip_high=0.28, tau_neg=2.0)
    close(grad, torch.full_like(r, 1 / 3))
    assert loss.item() == pytest.approx(4 / 2.0 * 0.5)  # -A (4 / tau) sigmoid(0) = 1
    # Unlike PPO, a ratio past the clip bound still learns (softly).
    _, ppo_grad, _ = _grad("ppo", old + r.log(), old, [1.0], mask, clip_low=0.2, clip_high=0.28)
    assert ppo_grad[0, 1] == 0.0 and grad[0, 1] != 0.0
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        _grad("sapo", old, old, [1.0], mask, clip_low=0.2, clip_high=0.2, tau_pos=0.0)


def test_gpg_loss_is_the_plain_policy_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.2]]))
    old = lp - 0.7  # off-policy: GPG does not care
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, grad, metrics = _grad("gpg", lp, old, [2.0, -1.0], mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-2 * (math.log(0.5) + math.log(0.25)) + math.log(0.1)) / 3)
    close(grad, [[-2 / 3, -2 / 3], [1 / 3, 0.0]])
    assert metrics["ratio_mean"] == pytest.approx(math.exp(0.7), rel=1e-5)


def test_sequence_level_cispo_by_hand():
    # Row 0: log-ratios [0.5, 0.1] -> s = e^0.3 = 1.35, clipped to 1 + 0.28 for both tokens
    # (token-level CISPO would weigh them 1.28 and e^0.1). Row 1: [0.1, -0.1] -> s = 1, unclipped.
    old = torch.full((2, 2), -1.0)
    lp = old + torch.tensor([[0.5, 0.1], [0.1, -0.1]])
    mask = torch.ones(2, 2)
    loss, grad, metrics = _grad("cispo_seq", lp, old, [1.0, -2.0], mask, clip_low=0.2, clip_high=0.28)
    close(grad, [[-1.28 / 4, -1.28 / 4], [2 / 4, 2 / 4]])
    expected = (-1.28 * (lp[0].sum()) + 2 * lp[1].sum()) / 4
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    assert metrics["clip_frac_high"] == pytest.approx(0.5)  # row 0's two tokens, unsigned
    _, token_grad, _ = _grad("cispo", lp, old, [1.0, -2.0], mask, clip_low=0.2, clip_high=0.28)
    assert token_grad[0, 1] == pytest.approx(-math.exp(0.1) / 4)  # the token form differs


@pytest.mark.parametrize("name", ["gmpo", "sapo", "gpg", "cispo_seq"])
def test_the_new_losses_refuse_dual_clip(name):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual-clip does not apply"):
        get_policy_loss(name)(
            x, x, torch.ones(1), torch.ones(1, 2), clip_low=0.2, clip_high=0.2, clip_dual=3.0
        )


# ---------------------------------------------------------------------------------------------
# KL: straight-through, abs, full


def test_straight_through_and_abs_kl_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # x = lp - ref = [0.5, -1]
    x = torch.tensor([[0.5, -1.0]])
    k3 = torch.exp(-x) - 1 + x
    for name, value, grad in [
        ("k1+", x, x),  # value of k1, gradient of k2 = x
        ("k3+", k3, x),
        ("k2+", 0.5 * x * x, x),
        ("abs", x.abs(), torch.sign(x)),
    ]:
        y = lp.clone().requires_grad_()
        kl = kl_estimate(y, ref, name)
        kl.sum().backward()
        close(kl.detach(), value)
        close(y.grad, grad)
    with pytest.raises(ValueError, match="'full' needs both models' distributions"):
        kl_estimate(lp, ref, "full")
    # In the loss, aggregated as the policy loss is: token mean of k1 values here.
    y = lp.clone().requires_grad_()
    assert kl_in_loss(y, ref, torch.ones(1, 2), estimator="k1+").item() == pytest.approx(-0.25)
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "k1+", "k2+", "k3+", "abs", "full"}


def _dense_kl(h, w, b, rh, rw, blocked, temperature, softcap=None):
    def logp(hh, ww, bb):
        z = hh @ ww.T + (bb if bb is not None else 0.0)
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        return torch.log_softmax(z[:, ~blocked] / temperature, dim=-1)

    lp, lq = logp(h, w, b), logp(rh, rw, None)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_full_kl_matches_the_dense_kl_in_value_and_gradient(softcap, chunk):
    g = torch.Generator().manual_seed(0)
    T, H, V = 5, 4, 9
    h = torch.randn(T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    rh, rw = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    blocked = torch.zeros(V, dtype=torch.bool)
    blocked[[2, 7]] = True
    weights = torch.randn(T, generator=g)
    kl = head_full_kl(h, w, rh, rw, blocked, 0.7, bias=b, softcap=softcap, chunk=chunk)
    dense = _dense_kl(h, w, b, rh, rw, blocked, 0.7, softcap)
    close(kl, dense, atol=1e-5, rtol=1e-5)
    assert (kl >= -1e-6).all()
    got = torch.autograd.grad((kl * weights).sum(), (h, w, b))
    want = torch.autograd.grad((dense * weights).sum(), (h, w, b))
    for a, e in zip(got, want):
        close(a, e, atol=1e-4, rtol=1e-4)  # float32 rounding of two different summation orders


def test_full_kl_never_allocates_more_than_one_chunk_of_the_vocabulary():
    """Forward and backward: every tensor with the vocabulary as last dim holds at most `chunk`
    positions (the dense form would build [T, V] for each model, and softmax copies of both)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):  # views allocate nothing
                self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                                if isinstance(t, torch.Tensor)]  # fmt: skip
            return out

    T, H, V, chunk = 40, 8, 301, 3
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    with Shapes() as record:
        head_full_kl(h, w, torch.randn(T, H), torch.randn(V, H), None, 1.0, chunk=chunk).sum().backward()
    vocab_sized = [s for s in record.shapes if s and s[-1] == V and s != (V, H)]
    assert vocab_sized and max(torch.Size(s).numel() for s in vocab_sized) <= chunk * V


def test_full_kl_is_zero_against_itself_and_checks_its_inputs():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 4, generator=g, requires_grad=True)
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    kl = head_full_kl(h, w, h.detach(), w.detach(), None, 1.0)
    assert kl.abs().max() < 1e-6
    kl.sum().backward()
    assert h.grad.abs().max() < 1e-6 and w.grad.abs().max() < 1e-6
    assert head_full_kl(h[:0], w, h[:0].detach(), w.detach(), None, 1.0).shape == (0,)
    with pytest.raises(ValueError, match="must match"):
        head_full_kl(h, w, h[:2].detach(), w.detach(), None, 1.0)
    with pytest.raises(ValueError, match="different vocabularies"):
        head_full_kl(h, w, h.detach(), w[:5].detach(), None, 1.0)


# ---------------------------------------------------------------------------------------------
# Off-policy sequence mask


def test_off_policy_sequence_mask_by_hand():
    sampling = torch.full((5, 2), -1.0)
    # Mean log(pi_sampling / pi_theta) per row: 0.6, 0.4, 0.9, 0.6, (no token).
    drift = torch.tensor([[0.6, 0.6], [0.2, 0.6], [0.9, 0.9], [1.2, 0.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    lp = sampling - drift
    a = torch.tensor([-1.0, -1.0, 1.0, -0.5, -1.0])
    keep, metrics = off_policy_sequence_mask(lp, sampling, a, mask, delta=0.5)
    # Row 0: A < 0, 0.6 > 0.5 -> dropped; row 1: 0.4 -> kept; row 2: A > 0 -> kept whatever the
    # drift; row 3: one token, 1.2 -> dropped; row 4: no token -> kept.
    assert keep.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert metrics["opsm/masked_frac"] == pytest.approx(2 / 4)
    assert metrics["opsm/kl_mean"] == pytest.approx((0.6 + 0.4 + 0.9 + 1.2) / 4)
    # As a per-token weight: the dropped rows send no gradient, the normaliser stays.
    x = lp.clone().requires_grad_()
    w = keep.unsqueeze(1).expand_as(mask)
    loss, _ = get_policy_loss("ppo")(x, lp, a, mask, clip_low=0.2, clip_high=0.2, weights=w)
    loss.backward()
    assert (x.grad[0] == 0).all() and (x.grad[3] == 0).all() and (x.grad[1] != 0).all()
    empty, metrics = off_policy_sequence_mask(lp, sampling, a, torch.zeros_like(mask), 0.5)
    assert empty.tolist() == [1.0] * 5 and metrics == {"opsm/masked_frac": 0.0, "opsm/kl_mean": 0.0}
    with pytest.raises(ValueError, match="delta must be >= 0"):
        off_policy_sequence_mask(lp, sampling, a, mask, -1.0)


# ---------------------------------------------------------------------------------------------
# Demonstrations


def test_demonstration_losses_by_hand():
    # Probabilities 0.5 (inside the trust region, alpha 0.1) and 0.05 (outside).
    lp = torch.log(torch.tensor([[0.5, 0.05]]))
    mask = torch.ones(1, 2)
    x = lp.clone().requires_grad_()
    loss, metrics = demonstration_loss(x, mask, "nll")
    loss.backward()
    assert loss.item() == pytest.approx((math.log(2) + math.log(20)) / 2)
    close(x.grad, [[-0.5, -0.5]])
    assert metrics["demo/nll"] == pytest.approx(loss.item()) and metrics["demo/trust_frac"] == 1.0
    x = lp.clone().requires_grad_()
    loss, metrics = demonstration_loss(x, mask, "trust_region", alpha=0.1)
    loss.backward()
    # Inside: plain NLL; outside: its gradient scaled by p / alpha = 0.5 (value likewise).
    assert loss.item() == pytest.approx((math.log(2) + 0.5 * math.log(20)) / 2)
    close(x.grad, [[-0.5, -0.25]])
    assert metrics["demo/trust_frac"] == 0.5 and metrics["demo/token_prob"] == pytest.approx(0.275)
    # The gradient equals TRAPO's own form, -p / max(sg(p), alpha).
    y = lp.clone().requires_grad_()
    p = y.exp()
    (-(p / p.detach().clamp(min=0.1)).sum() / 2).backward()
    close(x.grad, y.grad)


def test_demonstration_loss_edge_cases_and_micro_batches():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.9], [0.05, 0.2, 0.7]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    garbage = lp.clone()
    garbage[0, 2] = float("nan")
    x = garbage.clone().requires_grad_()
    full, _ = demonstration_loss(x, mask, "trust_region")
    full.backward()
    assert torch.isfinite(full) and x.grad[0, 2] == 0
    # Micro-batches with the mini-batch's token count as denominator sum to the whole.
    parts = [
        demonstration_loss(garbage[i : i + 1], mask[i : i + 1], "trust_region", denom=5.0)[0] for i in (0, 1)
    ]
    assert float(sum(parts)) == pytest.approx(full.item())
    # No token at all: 0 and no gradient.
    x = lp.clone().requires_grad_()
    loss, metrics = demonstration_loss(x, torch.zeros_like(mask), "nll")
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all() and metrics["demo/tokens"] == 0.0
    with pytest.raises(ValueError, match="unknown demonstration loss"):
        demonstration_loss(lp, mask, "luffy")
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        demonstration_loss(lp, mask, "trust_region", alpha=0.0)


# ---------------------------------------------------------------------------------------------
# The trainer's pieces on a tiny model


def _samples(n: int = 2):
    from mmrl.datasets.procedural import make_samples

    return make_samples(["colour_code"], n=n, split="train")


def test_procedural_samples_carry_a_demonstration_and_the_batch_lays_it_out(tiny_policy):
    from mmrl.train.batching import select_rows
    from mmrl.train.demonstrations import demonstrations

    samples = _samples(2)
    assert all(isinstance(s.extra_info["demonstration"], str) for s in samples)
    without = copy.deepcopy(samples[1])
    del without.extra_info["demonstration"]
    from mmrl.models.base import teacher_forced_batch

    rows = [samples[0], samples[0], without, without]  # two groups of 2; only the first has one
    batch = teacher_forced_batch(tiny_policy, rows, ["x", "y", "z", "w"])
    demos = demonstrations(tiny_policy, batch, 2)
    assert len(demos.batch) == 1 and demos.group_row == [0, -1]
    tokens = tiny_policy.processor.tokenizer(samples[0].extra_info["demonstration"], add_special_tokens=False)
    assert int(demos.batch.response_mask.sum()) == len(tokens["input_ids"]) + 1  # + the stop token
    # Each group's demonstration trains once: in the micro-batch holding its first row.
    assert demos.rows_for([0, 1]) == [0] and demos.rows_for([1]) == [] and demos.rows_for([2, 3]) == []
    assert demos.tokens_for([1, 2]) == 1.0
    assert select_rows(demos.batch, demos.rows_for([0])).samples[0] is samples[0]
    none = teacher_forced_batch(tiny_policy, [without, without], ["a", "b"])
    assert demonstrations(tiny_policy, none, 2) is None
    bad = copy.deepcopy(without)
    bad.extra_info["demonstration"] = 3
    with pytest.raises(ValueError, match="field 'extra_info.demonstration' must be a non-empty string"):
        demonstrations(tiny_policy, teacher_forced_batch(tiny_policy, [bad, bad], ["a", "b"]), 2)


def test_a_bad_demonstration_field_is_refused_when_a_record_is_read():
    from mmrl.datasets.schema import SampleError, sample_from_record

    record = {
        "data_source": "d",
        "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
        "reward_model": {"ground_truth": "2", "verifier": "math"},
        "extra_info": {"id": "a", "demonstration": ""},
    }
    with pytest.raises(SampleError, match="extra_info.demonstration"):
        sample_from_record(record, "x.jsonl:1")
    record["extra_info"]["demonstration"] = "\\boxed{2}"
    assert sample_from_record(record, "x.jsonl:1").extra_info["demonstration"] == "\\boxed{2}"


def test_full_kl_of_a_tiny_vlm_equals_the_kl_of_its_logits(tiny_policy):
    from mmrl.models.base import teacher_forced_batch
    from mmrl.train.batching import model_inputs
    from mmrl.train.forward import reference_hidden, response_logprobs, response_logprobs_and_full_kl

    samples = _samples(2)
    batch = teacher_forced_batch(
        tiny_policy, [samples[0], samples[0], samples[1]], ["\\boxed{3}", "ab", "\\boxed{12}"]
    )
    model = tiny_policy.model
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    blocked = tiny_policy.blocked
    logprobs, entropy, kl = response_logprobs_and_full_kl(
        model, batch, blocked, 1.0, reference_hidden(reference, batch)
    )
    plain, _ = response_logprobs(model, batch, blocked, 1.0)
    close(logprobs, plain, atol=1e-5, rtol=1e-5)
    # The dense KL from each model's own full logits at the response positions.
    P = batch.prompt_ids.shape[1]
    mask = batch.response_mask.bool()
    with torch.no_grad():
        dense = []
        for m in (model, reference):
            logits = (
                m(**model_inputs(batch)).logits[:, P - 1 : -1].float().masked_fill(blocked, float("-inf"))
            )
            dense.append(torch.log_softmax(logits, dim=-1))
        lp, lq = dense
        want = (lp.exp() * (lp - lq)).nan_to_num(0.0).sum(-1)
    close(kl[mask], want[mask], atol=1e-4, rtol=1e-4)
    assert (kl[~mask] == 0).all() and float(kl[mask].detach().min()) > 0
    # Gradients reach the policy; against itself the KL is 0.
    kl.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()
    _, _, self_kl = response_logprobs_and_full_kl(model, batch, blocked, 1.0, reference_hidden(model, batch))
    assert self_kl.abs().max() < 1e-5


def test_greedy_baselines_are_the_greedy_rewards_of_each_prompt(tiny_policy):
    from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
    from mmrl.router import Router
    from mmrl.train.baselines import greedy_baselines
    from mmrl.types import VerifyContext

    cfg = load_config(overrides=["rollout.group_size=2", "rollout.max_new_tokens=6", "algo.advantage=remax"])
    engine = HFRolloutEngine.from_policy(tiny_policy)
    router = Router(0, 5.0)
    samples = _samples(3)
    batch = engine.generate(samples, SamplingParams(n=2, max_new_tokens=6))
    scored = []

    def score(greedy):
        scored.append(greedy)
        return router.score(greedy.samples, greedy.texts, VerifyContext())

    base, metrics = greedy_baselines(cfg, engine, score, batch)
    greedy = scored[0]
    assert [s.id for s in greedy.samples] == [s.id for s in samples]  # one greedy response per prompt
    again = engine.generate(samples, SamplingParams(n=1, greedy=True, max_new_tokens=6))
    assert greedy.texts == again.texts  # argmax decoding: deterministic
    expected = router.score(again.samples, again.texts, VerifyContext()).scores
    close(base, expected.repeat_interleave(2))
    assert metrics["remax/baseline_errors"] == 0.0
    assert metrics["remax/baseline_mean"] == pytest.approx(float(expected.mean()))
    router.close()


# ---------------------------------------------------------------------------------------------
# Config: every new option can be switched on by an override, and bad values are refused


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.advantage=remax"],
        ["algo.advantage=opo"],
        ["algo.advantage=gpg", "algo.policy_loss=gpg"],
        ["algo.advantage=pass_at_k", "algo.passk_k=4"],
        ["algo.advantage=gdpo", "algo.gdpo_batch_norm=std"],
        [
            "algo.policy_loss=gmpo",
            "algo.clip_low=0.4",
            "algo.clip_high=0.4",
            "algo.loss_agg=seq_mean_token_mean",
        ],
        ["algo.policy_loss=sapo", "algo.sapo_tau_pos=1.0", "algo.sapo_tau_neg=1.05"],
        ["algo.policy_loss=cispo_seq"],
        ["algo.kl_coef=0.01", "algo.kl_estimator=k3+"],
        ["algo.kl_coef=0.01", "algo.kl_estimator=full"],
        ["algo.kl_coef=0.01", "algo.kl_estimator=abs"],
        ["algo.opsm_delta=0.5"],
        ["algo.demo_loss=trust_region", "algo.demo_coef=0.1", "algo.demo_alpha=0.1"],
        ["algo.demo_loss=nll"],
    ],
)
def test_every_new_option_loads_from_overrides(overrides):
    cfg = load_config("vision_reasoning", overrides=overrides)
    for o in overrides:
        key, value = o.split("=")
        assert str(getattr(cfg.algo, key.split(".")[1])) == value


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algo.policy_loss=nope"], "algo.policy_loss must be one of"),
        (["algo.kl_estimator=k4"], "algo.kl_estimator must be one of"),
        (["algo.policy_loss=gmpo", "algo.clip_dual=3.0"], "clip_dual does not apply to gmpo"),
        (["algo.advantage=pass_at_k", "algo.passk_k=9", "rollout.group_size=8"], "algo.passk_k must be in"),
        (["algo.advantage=pass_at_k", "algo.overlong_buffer=4"], "needs binary rewards"),
        (["algo.advantage=remax", "trainer.backend=ray"], "remax needs trainer.backend=local"),
        (["algo.gdpo_batch_norm=group"], "algo.gdpo_batch_norm must be one of"),
        (["algo.sapo_tau_neg=0"], "sapo_tau_pos and algo.sapo_tau_neg must be > 0"),
        (["algo.opsm_delta=-1"], "algo.opsm_delta must be >= 0"),
        (
            ["algo.kl_coef=0.1", "algo.kl_estimator=full", "algo.kl_in_reward=true"],
            "it needs algo.kl_in_reward=false",
        ),
        (
            ["algo.kl_coef=0.1", "algo.kl_estimator=full", "model.reference_on_cpu=true"],
            "reference_on_cpu=false",
        ),
        (["algo.demo_loss=sft"], "algo.demo_loss must be off, nll or trust_region"),
        (["algo.demo_loss=nll", "trainer.backend=ray"], "algo.demo_loss needs trainer.backend=local"),
        (["algo.demo_alpha=0"], "algo.demo_alpha must be in"),
    ],
)
def test_new_options_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_micro_batches_of_the_new_losses_sum_with_the_minibatch_denominator():
    # GMPO's per-token loss is its row's: micro-batches still sum to the mini-batch loss.
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(5, 4, generator=g) * 2
    lp = old + torch.randn(5, 4, generator=g) * 0.5
    mask = (torch.rand(5, 4, generator=g) > 0.3).float()
    a = torch.randn(5, generator=g)
    for agg in ("token_mean", "seq_mean_token_mean"):
        full, _ = get_policy_loss("gmpo")(lp, old, a, mask, clip_low=0.4, clip_high=0.4, agg=agg)
        d = loss_denominator(mask, agg)
        parts = [
            get_policy_loss("gmpo")(
                lp[r], old[r], a[r], mask[r], clip_low=0.4, clip_high=0.4, agg=agg, denom=d
            )[0]
            for r in (slice(0, 2), slice(2, 5))
        ]
        assert float(sum(parts)) == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.slow
def test_the_new_options_compose_in_two_steps_of_the_trainer(mmrl_cache, tmp_path):
    """ReMax's greedy baseline, the exact KL, GMPO, the off-policy sequence mask and the
    trust-region demonstration term, all at once, for two steps of the built-in task: each
    reports its metrics and nothing is skipped (the learning tests are tests/test_families.py's)."""
    import json

    from mmrl.train.grpo import train

    overrides = [
        "trainer.prompts_per_step=4", "rollout.group_size=2", "trainer.total_steps=2", "trainer.eval_size=8",
        "trainer.eval_every=2", "trainer.progress=false", "trainer.save_final=false", "trainer.threads=1",
        "algo.advantage=remax", "algo.policy_loss=gmpo", "algo.clip_low=0.4", "algo.clip_high=0.4",
        "algo.kl_coef=0.05", "algo.kl_estimator=full", "algo.opsm_delta=0.0", "algo.demo_loss=trust_region",
        f"trainer.run_dir={tmp_path}",
    ]  # fmt: skip
    train(load_config("vision_reasoning", overrides=overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["actor/skipped_steps"] == 0 and math.isfinite(r["actor/pg_loss"])
        assert r["remax/baseline_errors"] == 0 and 0 <= r["remax/baseline_mean"] <= 1
        assert r["demo/prompts"] == 4 and r["demo/nll"] > 0 and 0 <= r["demo/trust_frac"] <= 1
        assert 0 <= r["opsm/masked_frac"] <= 1
    # The first mini-batch of step 1 is the reference itself (KL 0); later ones have moved.
    assert steps[1]["actor/ref_kl"] > 0
