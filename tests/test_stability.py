"""Stability toolkit (issue 19, parts 1-3): IcePop token masking, rollout rejection, IS-weight
batch normalisation, Clip-Cov / KL-Cov (veRL's definitions), forking tokens, the adaptive
entropy coefficient and ProRL's reference reset: hand-worked values and gradients, edge cases,
config checks, one short in-process run of the built-in task per option, and the mismatch
demonstration (an injected rollout spike; bf16 against fp32 log-probs).

Checked against veRL itself (volcengine/verl at b178a3cd, 2026-01-29) in a scratch environment,
not kept here: its `compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov` and
`compute_rollout_rejection_mask` were taken from its source (with `verl_F.masked_sum/mean` as
veRL defines them) and run beside mmrl's on 50 seeded random batches (6 x 10, a quarter of the
tokens masked, normal advantages): Clip-Cov (same torch seed: the same random draw) and KL-Cov
gave identical losses and gradients (max difference 0.0); veRL's `seq_mean_k1`, `seq_sum_k1` and
`token_k1` with bounds "0.7_1.6" rejected exactly the responses mmrl's `geometric`, `sequence` and
`max_token` reject with low = 1 / 1.6, high = 1 / 0.7 (veRL's k1 is log rollout / trainer, the
inverse ratio)."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algos.losses import get_policy_loss
from mmrl.algos.stability import (
    AdaptiveEntropyCoef,
    batch_normalize_weights,
    forking_token_mask,
    rejection_keep,
)
from mmrl.algos.tis import tis_weights
from mmrl.config import load_config
from mmrl.train.stability import StabilityState, reset_reference

KW = {"clip_low": 0.2, "clip_high": 0.28}


def ratios_to_logprobs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, rollout) log-probs whose ratio trainer / rollout is `ratios` (rollout p = 0.1)."""
    r = torch.tensor(ratios)
    rollout = torch.full_like(r, math.log(0.1))
    return rollout + torch.log(r), rollout


# ---------------------------------------------------------------------------------------------
# IcePop: token-level masking outside a band


def test_band_masking_by_hand():
    trainer, rollout = ratios_to_logprobs([[0.4, 1.5, 6.0], [0.5, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, m = tis_weights(trainer, rollout, mask, level="token", cap=5.0, mode="band", low=0.5)
    # In the band [0.5, 5] (bounds included) a token keeps its own ratio; outside it weighs 0.
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0], [0.5, 5.0, 0.0]]))
    assert m["tis/masked_frac"] == pytest.approx(2 / 5)  # 0.4 and 6.0
    # The default lower bound is 1 / cap: with cap 2, 0.4 is out and 0.5 in.
    w, _ = tis_weights(trainer, rollout, mask, cap=2.0, mode="band")
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0], [0.5, 0.0, 0.0]]))
    # Sequence level: the product of the row's ratios is compared (row 0: 3.6, row 1: 2.5).
    w, _ = tis_weights(trainer, rollout, mask, level="sequence", cap=3.0, mode="band", low=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [2.5, 2.5, 0.0]]))


def test_band_masked_tokens_send_no_gradient_and_the_rest_are_weighted():
    trainer, rollout = ratios_to_logprobs([[0.4, 1.5, 6.0, 1.0]])
    mask = torch.ones(1, 4)
    w, _ = tis_weights(trainer, rollout, mask, cap=5.0, mode="band", low=0.5)
    lp = trainer.clone().requires_grad_()  # on-policy against the trainer: PPO ratio 1
    loss, _ = get_policy_loss("ppo")(lp, trainer, torch.tensor([2.0]), mask, weights=w, **KW)
    loss.backward()
    # d/dlp of mean_t(-A r_t w_t) at r = 1 is -A w_t / 4.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -2.0 * 1.5 / 4, 0.0, -2.0 / 4]]))
    assert loss.item() == pytest.approx(-2.0 * (1.5 + 1.0) / 4)


def test_band_with_every_token_masked_or_no_token_gives_zero_loss_and_no_nan():
    trainer, rollout = ratios_to_logprobs([[10.0, 0.01]])
    w, m = tis_weights(trainer, rollout, torch.ones(1, 2), cap=2.0, mode="band")
    assert (w == 0).all() and m["tis/masked_frac"] == 1.0
    lp = trainer.clone().requires_grad_()
    loss, _ = get_policy_loss("ppo")(lp, trainer, torch.tensor([1.0]), torch.ones(1, 2), weights=w, **KW)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    w, m = tis_weights(trainer, rollout, torch.zeros(1, 2), cap=2.0, mode="band")
    assert (w == 0).all() and m["tis/masked_frac"] == 0.0 and all(math.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match="low must be in"):
        tis_weights(trainer, rollout, torch.ones(1, 2), cap=2.0, mode="band", low=3.0)


# ---------------------------------------------------------------------------------------------
# Rollout rejection


def rejection_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Log-ratios: row 0 [0.1, 0.1, 1.6]; row 1 [-0.1, -0.1, pad]; row 2 padding only; row 3 [-1].
    x = torch.tensor([[0.1, 0.1, 1.6], [-0.1, -0.1, 9.0], [9.0, 9.0, 9.0], [-1.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    rollout = torch.full_like(x, -2.0)
    return rollout + x, rollout, mask


@pytest.mark.parametrize(
    "level, keep, token_frac",
    [
        # geometric means: e^0.6 = 1.82 (in [0.5, 2]), e^-0.1, -, e^-1 = 0.37 (out)
        ("geometric", [True, True, True, False], 1 / 6),
        # products: e^1.8 = 6.05 (out), e^-0.2, -, e^-1 (out)
        ("sequence", [False, True, True, False], 4 / 6),
        # any token out: e^1.6 = 4.95 in row 0, e^-1 in row 3
        ("max_token", [False, True, True, False], 4 / 6),
    ],
)
def test_rejection_by_hand(level, keep, token_frac):
    trainer, rollout, mask = rejection_inputs()
    kept, m = rejection_keep(trainer, rollout, mask, level=level, low=0.5, high=2.0)
    assert kept.tolist() == keep  # the empty row 2 is never rejected
    rejected_with_tokens = sum(1 for i, k in enumerate(keep) if not k and i != 2)
    assert m["rejection/seq_frac"] == pytest.approx(rejected_with_tokens / 3)
    assert m["rejection/token_frac"] == pytest.approx(token_frac)
    assert not kept.requires_grad


def test_rejection_geometric_statistics_and_edge_cases():
    trainer, rollout, mask = rejection_inputs()
    _, m = rejection_keep(trainer, rollout, mask, level="geometric", low=0.5, high=2.0)
    assert m["rejection/stat_max"] == pytest.approx(math.exp(0.6), rel=1e-5)
    assert m["rejection/stat_min"] == pytest.approx(math.exp(-1.0), rel=1e-5)
    # No token at all: everything kept, metrics finite.
    kept, m = rejection_keep(trainer, rollout, torch.zeros_like(mask), level="geometric")
    assert kept.all() and m["rejection/seq_frac"] == 0.0 and m["rejection/stat_max"] == 1.0
    # Every response out of the band: all rejected, the loss over the kept mask is 0, no NaN.
    kept, m = rejection_keep(trainer + 5.0, rollout, mask, level="geometric")
    assert kept.tolist() == [False, False, True, False] and m["rejection/seq_frac"] == 1.0
    lp = trainer.clone().requires_grad_()
    loss, _ = get_policy_loss("ppo")(lp, trainer, torch.ones(4), mask * kept.unsqueeze(1), **KW)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    with pytest.raises(ValueError, match="unknown rejection level"):
        rejection_keep(trainer, rollout, mask, level="token")
    with pytest.raises(ValueError, match="0 < low < high"):
        rejection_keep(trainer, rollout, mask, low=2.0, high=2.0)


# ---------------------------------------------------------------------------------------------
# IS-weight batch normalisation


def test_batch_normalisation_by_hand():
    w = torch.tensor([[1.0, 2.0], [4.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    normed, factor = batch_normalize_weights(w, mask, "token")
    assert factor == pytest.approx(7 / 3)
    torch.testing.assert_close(normed, torch.tensor([[3 / 7, 6 / 7], [12 / 7, 0.0]]))
    assert normed[mask > 0].mean().item() == pytest.approx(1.0)
    # Sequence level: rows weigh once each, mean of (1.5, 4) = 2.75.
    normed, factor = batch_normalize_weights(w, mask, "sequence")
    assert factor == pytest.approx(2.75)
    torch.testing.assert_close(normed, torch.tensor([[1 / 2.75, 2 / 2.75], [4 / 2.75, 0.0]]))


def test_batch_normalisation_edge_cases():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    normed, factor = batch_normalize_weights(torch.zeros(2, 2), mask, "token")  # all masked by TIS
    assert factor == 1.0 and (normed == 0).all()
    normed, factor = batch_normalize_weights(torch.ones(2, 2), torch.zeros(2, 2), "sequence")
    assert factor == 1.0 and (normed == 0).all()
    with pytest.raises(ValueError, match="unknown IS level"):
        batch_normalize_weights(torch.ones(2, 2), mask, "batch")


# ---------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (veRL's compute_policy_loss_clip_cov / compute_policy_loss_kl_cov)


def cov_inputs(row1_last: float = -3.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Two responses of two tokens, A = +1 and -1 (token mean of A: 0).
    lp = torch.tensor([[-0.5, -3.5], [-0.5, row1_last]])
    return lp, torch.tensor([1.0, -1.0]), torch.ones(2, 2)


def test_clip_cov_by_hand():
    lp0, adv, mask = cov_inputs()
    # mean log-prob -2: cov = A (lp + 2) = [[1.5, -1.5], [-1.5, 1.5]]; candidates in (1, 5):
    # (0, 0) and (1, 1); k = max(int(0.5 * 4), 1) = 2, so both lose their gradient.
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("clip_cov")(lp, lp0, adv, mask, cov_ratio=0.5, cov_lb=1.0, cov_ub=5.0, **KW)
    loss.backward()
    # On-policy r = 1: per-token losses -A = [[-1, -1], [1, 1]], kept on (0, 1) and (1, 0) -> 0.
    assert loss.item() == pytest.approx(0.0)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25], [0.25, 0.0]]))
    assert m["cov_frac"] == pytest.approx(0.5)
    # A token PPO already clips is no candidate: r = 1.5 > 1.28 on (0, 0) with A > 0.
    old = lp0.clone()
    old[0, 0] -= math.log(1.5)
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("clip_cov")(lp, old, adv, mask, cov_ratio=0.5, **KW)
    loss.backward()
    assert m["cov_frac"] == pytest.approx(0.25)  # only (1, 1)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 1.0 + 0.0) / 4, rel=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25], [0.25, 0.0]]))


def test_clip_cov_draws_k_of_the_candidates_at_random():
    lp0, adv, mask = cov_inputs()
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        lp = lp0.clone().requires_grad_()
        loss, m = get_policy_loss("clip_cov")(lp, lp0, adv, mask, cov_ratio=0.25, **KW)  # k = 1
        loss.backward()
        zero = [(i, j) for i in range(2) for j in range(2) if lp.grad[i, j] == 0]
        assert len(zero) == 1 and zero[0] in {(0, 0), (1, 1)} and m["cov_frac"] == 0.25
        seen.add(zero[0])
    assert seen == {(0, 0), (1, 1)}


def test_clip_cov_edge_cases():
    # A single token (and a singleton group): A - mean(A) = 0, no candidate: plain PPO.
    lp0 = torch.tensor([[-1.0]])
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("clip_cov")(lp, lp0, torch.tensor([2.0]), torch.ones(1, 1), **KW)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and lp.grad.item() == pytest.approx(-2.0) and m["cov_frac"] == 0
    # No token: loss 0, no NaN.
    lp0, adv, _ = cov_inputs()
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("clip_cov")(lp, lp0, adv, torch.zeros(2, 2), **KW)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all() and m["cov_frac"] == 0.0
    with pytest.raises(ValueError, match="dual-clip does not apply"):
        get_policy_loss("clip_cov")(lp, lp0, adv, torch.ones(2, 2), clip_dual=3.0, **KW)


def test_kl_cov_by_hand():
    lp0, adv, mask = cov_inputs(row1_last=-3.7)
    # mean log-prob -2.05: cov = [[1.55, -1.45], [-1.55, 1.65]]; k = max(int(0.25 * 4), 1) = 1:
    # (1, 1) gets + |log r|. Every log r = 0.1 (old = lp - 0.1), r = e^0.1.
    old = lp0 - 0.1
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("kl_cov")(lp, old, adv, mask, cov_ratio=0.25, kl_coef=1.0, **KW)
    loss.backward()
    e = math.exp(0.1)
    # Per-token: -A r = [[-e, -e], [e, e]], plus 0.1 on (1, 1); token mean.
    assert loss.item() == pytest.approx(0.1 / 4, rel=1e-4)
    torch.testing.assert_close(lp.grad, torch.tensor([[-e / 4, -e / 4], [e / 4, (e + 1) / 4]]))
    assert m["cov_frac"] == pytest.approx(0.25) and m["ppo_kl_abs"] == pytest.approx(0.1, rel=1e-5)


def test_kl_cov_does_not_clip_and_survives_edge_cases():
    # r = 2 with A > 0: PPO would send no gradient, KL-Cov sends -A r (veRL's KL-Cov never clips).
    lp0 = torch.tensor([[-1.0, -1.0]])
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("kl_cov")(lp, lp0 - math.log(2.0), torch.tensor([1.0]), torch.ones(1, 2), **KW)
    loss.backward()
    # cov = 0 on both (one response): the first is selected and adds |log r| = ln 2 (grad +1).
    torch.testing.assert_close(lp.grad, torch.tensor([[(-2.0 + 1.0) / 2, -2.0 / 2]]))
    assert m["clip_frac_high"] == 1.0  # reported, not applied
    lp = lp0.clone().requires_grad_()
    loss, m = get_policy_loss("kl_cov")(lp, lp0, torch.tensor([1.0]), torch.zeros(1, 2), **KW)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all() and m["cov_frac"] == 0.0


# ---------------------------------------------------------------------------------------------
# Forking tokens (Beyond the 80/20 rule)


def test_forking_tokens_by_hand():
    entropy = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2], [0.7, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    keep = forking_token_mask(entropy, mask, frac=0.4, scope="response")
    # Row 0: ceil(0.4 * 5) = 2 -> 0.9 and 0.5; row 1: at least one; row 2: ceil(1.2) = 2 of a
    # three-way tie -> the first two.
    expected = [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert keep.tolist() == expected
    # Batch scope: ceil(0.4 * 9) = 4 over the 9 tokens: 1.0, 1.0, 1.0, 0.9.
    keep = forking_token_mask(entropy, mask, frac=0.4, scope="batch")
    assert keep.tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert (forking_token_mask(entropy, torch.zeros_like(mask), 0.2) == 0).all()
    assert forking_token_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        forking_token_mask(entropy, mask, 0.0)


def test_forking_tokens_as_weights_keep_the_full_normaliser():
    entropy = torch.tensor([[0.1, 0.9, 0.2, 0.3]])
    mask = torch.ones(1, 4)
    fork = forking_token_mask(entropy, mask, frac=0.25)
    lp0 = torch.full((1, 4), -1.0)
    lp = lp0.clone().requires_grad_()
    loss, _ = get_policy_loss("ppo")(lp, lp0, torch.tensor([1.0]), mask, weights=fork, **KW)
    loss.backward()
    # Only token 1 learns; the loss is still divided by all 4 tokens (the paper's objective).
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25, 0.0, 0.0]]))
    assert loss.item() == pytest.approx(-0.25)


# ---------------------------------------------------------------------------------------------
# Adaptive entropy coefficient (Skywork-OR1)


def test_adaptive_entropy_coefficient_by_hand():
    c = AdaptiveEntropyCoef(coef=0.01, target=0.5, delta=0.005, max_coef=0.02)
    assert c.current() == 0.01  # the first step applies the starting value
    assert c.update(0.3) == pytest.approx(0.015)  # below target: up, and applied
    assert c.update(0.3) == pytest.approx(0.02)
    assert c.update(0.3) == pytest.approx(0.02)  # capped at max_coef
    assert c.update(0.8) == 0.0 and c.coef == pytest.approx(0.015)  # above target: down, not applied
    assert c.update(0.5) == pytest.approx(0.015)  # at target: unchanged, applied
    for _ in range(10):
        c.update(0.9)
    assert c.coef == 0.0 and c.current() == 0.0  # floored at 0
    assert c.update(float("nan")) == 0.0 and c.coef == 0.0  # a non-finite entropy changes nothing


# ---------------------------------------------------------------------------------------------
# ProRL reference reset


def test_reference_reset_copies_the_policy_and_optionally_clears_the_optimizer(tiny_policy):
    model = tiny_policy.model
    reference = copy.deepcopy(model).to(torch.float16).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**_dummy_inputs(model)).logits.float().sum().backward()
    optimizer.step()  # the policy moves away from the reference; AdamW has state
    pairs = list(zip(model.parameters(), reference.parameters()))
    assert any(not torch.equal(p.detach().to(torch.float16), q) for p, q in pairs)
    t = SimpleNamespace(reference=reference, policy=tiny_policy, optimizer=optimizer)
    reset_reference(t, clear_optimizer=False)
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert q.dtype == torch.float16 and torch.equal(p.detach().to(torch.float16), q), n
    assert len(optimizer.state) > 0
    reset_reference(t, clear_optimizer=True)
    assert len(optimizer.state) == 0
    with pytest.raises(ValueError, match="need a frozen reference copy"):
        reset_reference(
            SimpleNamespace(reference="adapters_disabled", policy=tiny_policy, optimizer=optimizer)
        )


def test_reference_reset_schedule_every_n_steps_and_on_a_kl_bound():
    policy = torch.nn.Linear(2, 2)
    reference = copy.deepcopy(policy).requires_grad_(False)
    t = SimpleNamespace(reference=reference, policy=SimpleNamespace(model=policy), optimizer=None)
    cfg = load_config(overrides=["algo.kl_coef=0.01", "algo.ref_reset_every=3", "algo.ref_reset_kl=0.5"])
    state = StabilityState()
    fired = []
    for step, kl in enumerate([0.1, 0.6, 0.1, 0.1, 0.1, 0.1, 0.9], start=1):
        with torch.no_grad():
            policy.weight += 1.0  # the policy moves every step
        out = state.after_update(cfg, t, {"actor/ref_kl": kl, "actor/skipped_steps": 0.0}, step)
        fired.append(out["event/ref_reset"])
        if out["event/ref_reset"]:
            assert torch.equal(reference.weight, policy.weight)
    # Step 2: the KL bound; step 5: 3 steps after the last reset; step 7: the bound again.
    assert fired == [0, 1, 0, 0, 1, 0, 1] and state.resets == [2, 5, 7]
    # A step that did not update the policy never resets.
    out = state.after_update(cfg, t, {"actor/ref_kl": 0.9, "actor/skipped_steps": 1.0}, 8)
    assert out["event/ref_reset"] == 0


def _dummy_inputs(model) -> dict:
    return {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}


# ---------------------------------------------------------------------------------------------
# Config checks


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.tis_mode=clip"], "algo.tis_mode must be truncate, mask or band"),
        (["algo.tis=token", "algo.tis_mode=band", "algo.tis_low=3.0"], "algo.tis_low must be"),
        (["algo.tis_batch_norm=true"], "algo.tis_batch_norm needs algo.tis"),
        (["algo.rejection=token"], "algo.rejection must be off"),
        (["algo.rejection=geometric", "algo.old_logprobs=rollout"], "algo.rejection needs"),
        (["algo.rejection=geometric", "algo.rejection_high=0.5"], "algo.rejection_low"),
        (["algo.policy_loss=clip_cov", "algo.clip_dual=3.0"], "clip_dual does not apply"),
        (["algo.cov_ratio=0"], "algo.cov_ratio must be in"),
        (["algo.clip_cov_lb=5", "algo.clip_cov_ub=1"], "algo.clip_cov_lb must be"),
        (["algo.entropy_target=0.5", "algo.entropy_coef=0.5"], "adaptive coefficient's start"),
        (["algo.forking_frac=1.5"], "algo.forking_frac must be in"),
        (["algo.forking_scope=token"], "algo.forking_scope must be"),
        (["algo.ref_reset_every=10"], "need a reference"),
        (
            ["algo.ref_reset_kl=0.1", "algo.kl_coef=0.01", "algo.kl_in_reward=true"],
            "needs algo.kl_in_reward=false",
        ),
        (["algo.ref_reset_every=10", "algo.kl_coef=0.01", "model.lora_rank=8"], "not supported with LoRA"),
    ],
)
def test_stability_fields_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


# ---------------------------------------------------------------------------------------------
# Each option in the trainer: two steps of the built-in task


SHORT = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.total_steps=2",
    "trainer.eval_size=8",
    "trainer.eval_every=2",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.threads=1",
]


def _run(tmp_path, *overrides: str) -> list[dict]:
    from mmrl.train.grpo import train

    cfg = load_config("vision_reasoning", overrides=[*SHORT, *overrides, f"trainer.run_dir={tmp_path}"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/skipped_steps"] == 0, r
    return steps


@pytest.mark.slow
def test_band_masking_and_batch_norm_run_and_report_per_source(mmrl_cache, tmp_path):
    steps = _run(
        tmp_path, "algo.tis=token", "algo.tis_mode=band", "algo.tis_cap=2.0", "algo.tis_batch_norm=true"
    )
    for r in steps:
        assert r["mismatch/masked_token_frac"] == 0.0  # the HF engine runs the trainer's weights
        assert any(k.startswith("mismatch/masked_token_frac/") for k in r)
        assert r["tis/normalized_weight_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_rejection_runs_and_reports_per_source(mmrl_cache, tmp_path):
    # A band that excludes ratio 1 rejects every response: nothing trains, nothing breaks.
    steps = _run(tmp_path, "algo.rejection=geometric", "algo.rejection_low=1.5", "algo.rejection_high=2.0")
    for r in steps:
        assert r["mismatch/rejected_frac"] == 1.0 and r["rejection/seq_frac"] == 1.0
        assert any(k.startswith("mismatch/rejected_frac/") for k in r)
        assert r["actor/pg_loss"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_covariance_losses_run(loss, mmrl_cache, tmp_path):
    # A wide candidate window (-100, 100) so that Clip-Cov's selection happens on this tiny task
    # (its covariances stay far below veRL's default lower bound of 1).
    steps = _run(
        tmp_path,
        f"algo.policy_loss={loss}",
        "algo.cov_ratio=0.2",
        "algo.clip_cov_lb=-100",
        "algo.clip_cov_ub=100",
    )
    assert all(r["actor/cov_frac"] > 0 for r in steps)


@pytest.mark.slow
def test_adaptive_entropy_runs_and_moves_the_coefficient(mmrl_cache, tmp_path):
    steps = _run(
        tmp_path, "algo.entropy_target=100.0", "algo.entropy_coef=0.001", "algo.entropy_coef_delta=0.002"
    )
    # The entropy is far below the target: the coefficient rises by delta each step.
    assert [r["entropy/coef"] for r in steps] == pytest.approx([0.001, 0.003])
    assert steps[-1]["entropy/next_coef"] == pytest.approx(0.005)


def test_stability_state_round_trips_through_a_state_dict():
    state = StabilityState(AdaptiveEntropyCoef(coef=0.01, target=0.5, delta=0.005, max_coef=0.02), 4, [4])
    state.entropy.update(0.3)
    restored = StabilityState()
    restored.load_state_dict(copy.deepcopy(state.state_dict()))
    assert restored == state and restored.entropy.current() == pytest.approx(0.015)


@pytest.mark.slow
def test_a_resumed_run_continues_the_adaptive_entropy_coefficient(mmrl_cache, tmp_path):
    args = ["algo.entropy_target=100.0", "algo.entropy_coef=0.001", "algo.entropy_coef_delta=0.002"]
    _run(tmp_path, *args)  # two steps, then a checkpoint
    from mmrl.train.grpo import train

    overrides = [*SHORT, *args, "trainer.total_steps=3", "trainer.resume=auto", f"trainer.run_dir={tmp_path}"]
    train(load_config("vision_reasoning", overrides=overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "entropy/coef" in r]
    # Not back at the starting 0.001: step 3 applies what step 2 left (0.005).
    assert [r["entropy/coef"] for r in steps] == pytest.approx([0.001, 0.003, 0.005])


@pytest.mark.slow
def test_forking_tokens_run(mmrl_cache, tmp_path):
    steps = _run(tmp_path, "algo.forking_frac=0.2")
    assert all(0 < r["actor/forking_frac"] < 1 for r in steps)


@pytest.mark.slow
def test_reference_reset_runs_and_is_logged_as_an_event(mmrl_cache, tmp_path, caplog):
    caplog.set_level("INFO", logger="mmrl.train.stability")
    steps = _run(tmp_path, "algo.kl_coef=0.01", "algo.ref_reset_every=2", "algo.ref_reset_optimizer=true")
    assert [r["event/ref_reset"] for r in steps] == [0.0, 1.0]
    assert steps[1]["event/optimizer_reset"] == 1.0
    assert "step 2: reference reset to the current policy" in caplog.text


@pytest.mark.slow
def test_a_resumed_run_keeps_the_reset_reference(mmrl_cache, tmp_path):
    """The reference after a reset is the policy of that step: a checkpoint carries it, and a
    resumed run's reference equals the uninterrupted run's, not the initial one."""
    from mmrl.models.base import builtin_base
    from mmrl.models.loading import load_policy
    from mmrl.train.data import PromptSampler, load_data
    from mmrl.train.grpo import RunProgress, make_trainee, resume_from, write_checkpoint

    args = ["algo.kl_coef=0.01", "trainer.total_steps=2"]
    cfg = load_config("vision_reasoning", overrides=[*SHORT, *args, f"trainer.run_dir={tmp_path}"])

    t = make_trainee(cfg, load_policy(builtin_base(cfg)))
    t.router.close()
    with torch.no_grad():
        for p in t.policy.model.parameters():
            p.add_(0.01)  # the policy has moved away from the initial weights
    reset_reference(t)
    t.stability.resets.append(1)
    sampler = PromptSampler(load_data(cfg)[0], cfg.trainer.seed)
    path = write_checkpoint(cfg, t, sampler, RunProgress(step=1), tmp_path)
    fresh = make_trainee(cfg, load_policy(builtin_base(cfg)))
    fresh.router.close()
    first = next(iter(fresh.reference.parameters()))
    assert not torch.equal(first, next(iter(t.reference.parameters())))  # the initial reference
    assert resume_from(cfg, fresh, sampler, RunProgress(), tmp_path, checkpoint=path)
    for a, b in zip(fresh.reference.state_dict().values(), t.reference.state_dict().values()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Mismatch demonstration: a known perturbation of the rollout log-probs


def _grad_norm(
    trainer: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor, adv: torch.Tensor
) -> float:
    lp = trainer.clone().requires_grad_()
    loss, _ = get_policy_loss("ppo")(lp, trainer, adv, mask, weights=weights, **KW)
    loss.backward()
    return float(lp.grad.norm())


def test_a_rollout_spike_blows_up_plain_is_and_masking_or_rejection_keep_the_update_bounded():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(8, 16, generator=g) * 3
    mask = torch.ones(8, 16)
    adv = torch.tensor([1.0, -1.0] * 4)
    # A bf16-sized jitter everywhere, and on rows 0 and 1 one token the rollout engine gave
    # e^-6 of the trainer's probability (the sudden late-training gap).
    rollout = trainer + torch.randn(8, 16, generator=g) * 0.01
    rollout[0, 3] -= 6.0
    rollout[1, 7] -= 6.0
    nominal = _grad_norm(trainer, None, mask, adv)  # no mismatch at all
    plain, _ = tis_weights(trainer, rollout, mask, level="sequence", cap=1e30)  # untruncated IS
    band, m_band = tis_weights(trainer, rollout, mask, level="sequence", cap=2.0, mode="band")
    keep, m_rej = rejection_keep(trainer, rollout, mask, level="max_token", low=0.5, high=2.0)
    # The metrics see it: 2 of 8 responses / 32 of 128 tokens out of the band.
    assert m_band["tis/masked_frac"] == pytest.approx(32 / 128) and m_band["tis/weight_max"] > 300
    assert (
        m_rej["rejection/seq_frac"] == pytest.approx(2 / 8) and keep.tolist() == [False, False] + [True] * 6
    )
    # Plain sequence IS multiplies those rows' gradients by ~e^6 = 403; masking leaves the other
    # rows' gradient, within a few percent of the nominal one.
    assert _grad_norm(trainer, plain, mask, adv) > 100 * nominal
    assert _grad_norm(trainer, band, mask, adv) <= 1.1 * nominal
    # Rejection: 6 rows of 16 tokens each get -A / 96 (the token mean is over the kept tokens).
    rejected_norm = _grad_norm(trainer, None, mask * keep.unsqueeze(1), adv)
    assert rejected_norm == pytest.approx(nominal * math.sqrt(128 / 96), rel=1e-5)


def test_bfloat16_rollout_log_probs_differ_from_float32_and_the_metrics_see_it(tiny_policy):
    model = tiny_policy.model.eval()
    ids = torch.randint(0, 200, (4, 24), generator=torch.Generator().manual_seed(0))

    def token_logprobs(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
        return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    trainer = token_logprobs(model)
    rollout = token_logprobs(copy.deepcopy(model).to(torch.bfloat16))
    mask = torch.ones_like(trainer)
    _, m = tis_weights(trainer, rollout, mask, level="token", cap=2.0)
    assert m["rollout/kl_k3"] > 0 and m["tis/weight_max"] != m["tis/weight_min"]
    # A band as tight as the precision gap masks some tokens, and not all.
    x = (trainer - rollout).abs().max().item()
    _, m = tis_weights(trainer, rollout, mask, level="token", cap=math.exp(x / 2), mode="band")
    assert 0 < m["tis/masked_frac"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("option", ["band", "rejection"])
def test_an_injected_rollout_spike_is_seen_and_masked_in_the_trainer(
    option, mmrl_cache, tmp_path, monkeypatch
):
    from mmrl.rollout.hf import HFRolloutEngine

    generate = HFRolloutEngine.generate

    def spiked(self, *args, **kwargs):
        batch = generate(self, *args, **kwargs)
        batch.rollout_logprobs = batch.rollout_logprobs.clone()
        batch.rollout_logprobs[::2, 0] -= 3.0  # every other response: its first token, ratio e^3
        return batch

    monkeypatch.setattr(HFRolloutEngine, "generate", spiked)
    if option == "band":
        steps = _run(tmp_path, "algo.tis=token", "algo.tis_mode=band", "algo.tis_cap=2.0")
        for r in steps:  # one token in each of 4 of the 8 responses
            tokens = r["response/length_mean"] * 8
            assert r["mismatch/masked_token_frac"] == pytest.approx(4 / tokens, rel=1e-6)
            assert r["tis/weight_max"] == pytest.approx(math.exp(3.0), rel=0.05)
    else:
        steps = _run(tmp_path, "algo.rejection=max_token", "algo.rejection_high=2.0")
        assert all(r["mismatch/rejected_frac"] == 0.5 for r in steps)
