"""What every registered policy loss and advantage estimator gets from the shared registration
code (`token_loss` in mmrl/algos/losses.py, `group_estimator` in mmrl/algos/advantages.py): the
input checks, the per-token weights, the aggregation, the grouping of rows by prompt. Each test
runs over the whole registry, so a loss or estimator added later is held to the same contract."""

from __future__ import annotations

import inspect

import pytest
import torch

from mmrl.algos.advantages import ADVANTAGE_ESTIMATORS, GROUP_LOCAL, NEEDS_BASELINE, TOKEN_WEIGHTED
from mmrl.algos.losses import AGGREGATIONS, NO_DUAL_CLIP, POLICY_LOSSES, get_policy_loss

# Options that make the covariance losses select some tokens in a batch this small.
OPTIONS = {"clip_cov": {"cov_ratio": 0.2, "cov_lb": -5.0, "cov_ub": 5.0}, "kl_cov": {"cov_ratio": 0.2}}


def batch(seed: int = 0, n: int = 6, r: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, r, generator=g) * 3
    lp = old + torch.randn(n, r, generator=g) * 0.5  # ratios on both sides of the clip bounds
    advantages = torch.randn(n, generator=g)
    mask = (torch.rand(n, r, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return lp, old, advantages, mask


def loss_and_grad(name: str, lp, old, advantages, mask, **kw):
    x = lp.clone().requires_grad_()
    torch.manual_seed(0)  # Clip-Cov draws its tokens with torch's global generator
    loss, metrics = get_policy_loss(name)(
        x, old, advantages, mask, clip_low=0.2, clip_high=0.28, **OPTIONS.get(name, {}), **kw
    )
    loss.backward()
    return loss, x.grad, metrics


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_weights_scale_every_loss_before_any_aggregation(name, agg):
    # A constant per-token weight c scales the loss and its gradient by exactly c, whatever the
    # aggregation; a weight on one token moves only that token's gradient.
    lp, old, advantages, mask = batch()
    loss, grad, metrics = loss_and_grad(name, lp, old, advantages, mask, agg=agg, max_len=8)
    c = 0.25  # a power of two: the products are exact
    scaled, scaled_grad, scaled_metrics = loss_and_grad(
        name, lp, old, advantages, mask, agg=agg, max_len=8, weights=torch.full_like(lp, c)
    )
    assert scaled.item() == pytest.approx(c * loss.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(scaled_grad, c * grad)
    assert scaled_metrics == metrics  # the metrics describe the ratios, not the weighting
    i, t = (grad != 0).nonzero()[0].tolist()
    w = torch.ones_like(lp)
    w[i, t] = 0.0
    _, one_off, _ = loss_and_grad(name, lp, old, advantages, mask, agg=agg, max_len=8, weights=w)
    if name != "gmpo":  # GMPO's per-token loss is its row's: every token's gradient reads all
        assert (one_off != grad).nonzero().tolist() == [[i, t]] and one_off[i, t] == 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_checks_its_inputs_under_its_own_name(name):
    lp, old, advantages, mask = batch()
    with pytest.raises(ValueError, match=rf"^{name}: mask has shape \[6, 4\], logprobs has \[6, 5\]"):
        loss_and_grad(name, lp, old, advantages, mask[:, :4])
    with pytest.raises(ValueError, match=rf"^{name}: weights has shape"):
        loss_and_grad(name, lp, old, advantages, mask, weights=torch.ones(6, 4))
    with pytest.raises(ValueError, match=rf"^{name}: advantages must be \[N\] = \[6\]"):
        loss_and_grad(name, lp, old, advantages[:2], mask)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss_and_grad(name, lp, old, advantages, mask, agg="mean")
    with pytest.raises(TypeError, match="no_such_option"):
        loss_and_grad(name, lp, old, advantages, mask, no_such_option=1.0)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_dual_clip_is_refused_exactly_by_the_losses_that_say_so(name):
    lp, old, advantages, mask = batch()
    if name in NO_DUAL_CLIP:
        with pytest.raises(ValueError, match=rf"^{name}: dual-clip does not apply \(.+\)"):
            loss_and_grad(name, lp, old, advantages, mask, clip_dual=3.0)
    else:
        loss, _, metrics = loss_and_grad(name, lp, old, advantages, mask, clip_dual=3.0)
        assert torch.isfinite(loss) and "clip_frac_dual" in metrics
        with pytest.raises(ValueError, match=rf"^{name}: clip_dual must be > 1"):
            loss_and_grad(name, lp, old, advantages, mask, clip_dual=1.0)


def test_a_loss_shows_the_common_signature_and_its_own_options():
    params = inspect.signature(get_policy_loss("clip_cov")).parameters
    assert list(params)[:11] == [
        "logprobs", "old_logprobs", "advantages", "mask", "clip_low", "clip_high", "clip_dual",
        "agg", "denom", "weights", "max_len",
    ]  # fmt: skip
    options = {k: (p.kind, p.default) for k, p in list(params.items())[11:]}
    keyword = inspect.Parameter.KEYWORD_ONLY
    assert options == {"cov_ratio": (keyword, 2e-4), "cov_lb": (keyword, 1.0), "cov_ub": (keyword, 5.0)}
    assert get_policy_loss("ppo").__name__ == "ppo_loss" and "Schulman" in get_policy_loss("ppo").__doc__


# ---------------------------------------------------------------------------------------------
# Advantage estimators


def estimator_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n,), generator=g).float()  # binary: pass_at_k accepts it too
    extra = {
        "token_counts": torch.randint(1, 9, (n,), generator=g),
        "baselines": torch.rand(n, generator=g),
        "valid": torch.rand(n, generator=g) > 0.2,
    }
    return rewards, extra


def call(name: str, rewards: torch.Tensor, group_size: int, extra: dict) -> torch.Tensor:
    kw = {"valid": extra["valid"], "eps": 1e-6}
    if name in TOKEN_WEIGHTED:
        kw["token_counts"] = extra["token_counts"]
    if name in NEEDS_BASELINE:
        kw["baselines"] = extra["baselines"]
    if name == "pass_at_k":
        kw["k"] = 2
    if name == "gdpo":
        rewards = torch.stack([rewards, 1 - rewards], dim=-1)
    return ADVANTAGE_ESTIMATORS[name](rewards, group_size, **kw)


@pytest.mark.parametrize("name", sorted(GROUP_LOCAL))
def test_group_local_estimators_give_each_group_what_it_gets_alone(name):
    # What `reward.update_while_scoring` relies on: rows are prompt-major, and a group-local
    # estimator's advantages for a group depend on that group's rows only.
    G, B = 4, 5
    rewards, extra = estimator_inputs(G * B)
    whole = call(name, rewards, G, extra)
    for i in range(B):
        rows = slice(i * G, (i + 1) * G)
        alone = call(name, rewards[rows], G, {k: v[rows] for k, v in extra.items()})
        torch.testing.assert_close(whole[rows], alone, rtol=0, atol=0)
    assert whole.abs().sum() > 0  # not a vacuous pass: some group had a signal


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_gives_invalid_rows_zero_and_returns_one_value_per_row(name):
    rewards, extra = estimator_inputs(12, seed=1)
    got = call(name, rewards, 4, extra)
    assert got.shape == (12,) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got[~extra["valid"]] == 0).all()
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        call(name, rewards, 5, extra)
