"""The flow-GRPO SDE step and the objective's pieces, against hand-worked numbers and properties."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algos.sde import (
    clipped_step_loss,
    flow_grpo_advantages,
    mean_kl,
    ode_step,
    sde_step_with_logprob,
)

X = torch.tensor([[1.0, -2.0]])
V = torch.tensor([[0.5, 1.0]])


def test_sde_step_matches_the_closed_form_gaussian_log_density():
    """sigma = 0.5, sigma' = 0.25, a = 0.5, worked by hand:
    std_t = 0.5 sqrt(0.5 / 0.5) = 0.5, dt = -0.25, std_t^2 / (2 sigma) = 0.25,
    mean = x + [v + 0.25 (x + 0.5 v)] dt = [0.796875, -2.15625], step std = 0.5 sqrt(0.25) = 0.25,
    log p([0.9, -2.1]) = -mean([0.103125^2, 0.05625^2]) / (2 * 0.0625) - log 0.25 - log sqrt(2 pi)."""
    prev = torch.tensor([[0.9, -2.1]])
    out = sde_step_with_logprob(V, X, 0.5, 0.25, noise_level=0.5, prev_sample=prev)
    assert out.mean[0].tolist() == pytest.approx([0.796875, -2.15625], abs=1e-6)
    assert float(out.std) == pytest.approx(0.25)
    expected = -0.0551953125 - math.log(0.25) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.tolist() == pytest.approx([expected], abs=1e-6)
    assert expected == pytest.approx(0.4121605154, abs=1e-9)
    # the same number from torch's Normal, element-wise then averaged
    normal = torch.distributions.Normal(out.mean, 0.25)
    assert float(out.log_prob) == pytest.approx(float(normal.log_prob(prev).mean()), abs=1e-6)
    assert torch.equal(out.prev_sample, prev)


def test_per_sample_sigmas_give_the_same_step_as_scalars():
    torch.manual_seed(0)
    x, v, prev = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    for sde_type in ("sde", "cps"):
        scalar = sde_step_with_logprob(v, x, 0.7, 0.5, 0.8, prev_sample=prev, sde_type=sde_type)
        per_row = sde_step_with_logprob(
            v, x, torch.full((3,), 0.7), torch.full((3,), 0.5), 0.8, prev_sample=prev, sde_type=sde_type
        )
        torch.testing.assert_close(per_row.mean, scalar.mean)
        torch.testing.assert_close(per_row.log_prob, scalar.log_prob)
        torch.testing.assert_close(per_row.std.reshape(-1), scalar.std.reshape(-1).expand(3))


def test_small_noise_level_gives_the_ode_euler_step():
    torch.manual_seed(0)
    x, v = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    euler = x + (0.6 - 0.8) * v
    for a in (1e-2, 1e-3, 1e-4):
        out = sde_step_with_logprob(v, x, 0.8, 0.6, noise_level=a)
        gap = (out.mean - euler).abs().max().item()
        assert gap < 10 * a * a + 1e-6  # the correction is O(a^2) (plus float32 rounding)
    # the ODE step is diffusers' scheduler step
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    ref = sched.step(v, sched.timesteps[1], x, return_dict=False)[0]
    s = sched.sigmas.tolist()
    assert torch.equal(ode_step(v, x, s[1], s[2]), ref)


def test_a_sampled_latent_has_the_log_prob_recomputed_from_it():
    torch.manual_seed(0)
    x, v = torch.randn(4, 16, 8, 8), torch.randn(4, 16, 8, 8)
    g = torch.Generator().manual_seed(1)
    for sde_type in ("sde", "cps"):
        drawn = sde_step_with_logprob(v, x, 0.9, 0.7, 0.7, generator=g, sde_type=sde_type)
        again = sde_step_with_logprob(v, x, 0.9, 0.7, 0.7, prev_sample=drawn.prev_sample, sde_type=sde_type)
        assert torch.equal(again.log_prob, drawn.log_prob)
        assert torch.equal(again.mean, drawn.mean)
    # for the flow-GRPO SDE the log-prob of its own sample is the standard normal's of the noise
    noise = torch.randn(4, 16, 8, 8, generator=g)
    out = sde_step_with_logprob(v, x, 0.9, 0.7, 0.7, noise=noise)
    std = float(out.std)
    expected = -noise.square().mean(dim=(1, 2, 3)) / 2 - math.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)


def test_cps_preserves_the_marginal_variance():
    """With x_sigma = (1 - sigma) x0 + sigma eps and the exact velocity v = eps - x0, a CPS step
    lands on (1 - sigma') x0 + (noise with variance sigma'^2), for any noise level."""
    torch.manual_seed(0)
    n = 200_000
    x0 = torch.randn(n, 1) * 0.5 + 2.0
    eps = torch.randn(n, 1)
    sigma, sigma_next = 0.8, 0.5
    x = (1 - sigma) * x0 + sigma * eps
    v = eps - x0
    for a in (0.3, 0.7, 1.0):
        out = sde_step_with_logprob(v, x, sigma, sigma_next, a, sde_type="cps")
        residual = out.prev_sample - (1 - sigma_next) * x0
        assert float(residual.mean()) == pytest.approx(0.0, abs=5e-3)
        assert float(residual.var()) == pytest.approx(sigma_next**2, rel=1e-2)
        # its noise is s = sigma' sin(a pi / 2)
        assert float(out.std) == pytest.approx(sigma_next * math.sin(a * math.pi / 2))


def test_the_first_step_at_sigma_one_is_finite():
    torch.manual_seed(0)
    x, v = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    out = sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7)
    # std = a sqrt(sigma / (1 - sigma)) with the next sigma in the denominator: 0.7 sqrt(1 / 0.1)
    assert float(out.std) == pytest.approx(0.7 * math.sqrt(10.0) * math.sqrt(0.1))
    for t in (out.prev_sample, out.log_prob, out.mean):
        assert torch.isfinite(t).all()
    per_row = sde_step_with_logprob(
        v, x, torch.ones(2), torch.full((2,), 0.9), 0.7, prev_sample=out.prev_sample
    )
    torch.testing.assert_close(per_row.log_prob, out.log_prob)
    # the last step (sigma' = 0) too
    last = sde_step_with_logprob(v, x, 0.1, 0.0, noise_level=0.7)
    assert torch.isfinite(last.log_prob).all()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(V, X, 0.5, 0.25, sde_type="ode")
    with pytest.raises(ValueError, match="noise_level > 0"):
        sde_step_with_logprob(V, X, 0.5, 0.25, noise_level=0.0)


def test_kl_on_the_predicted_mean():
    mean = torch.tensor([[1.0, 2.0]])
    ref = torch.tensor([[0.5, 2.0]])
    # (0.25 + 0) / 2 elements / (2 * 0.5^2)
    assert mean_kl(mean, ref, torch.tensor(0.5)).tolist() == pytest.approx([0.25])
    assert mean_kl(mean, ref, torch.tensor(0.5), "cps").tolist() == pytest.approx([0.125])
    # equals torch's KL between the two Gaussians, averaged over elements
    p = torch.distributions.Normal(mean, 0.5)
    q = torch.distributions.Normal(ref, 0.5)
    assert float(mean_kl(mean, ref, torch.tensor(0.5))) == pytest.approx(
        float(torch.distributions.kl_divergence(p, q).mean())
    )


def test_per_prompt_advantages_by_hand():
    r = torch.tensor([1.0, 3.0, 10.0, 10.0])  # two prompts, G = 2
    # flow_grpo's PerPromptStatTracker: population std (np.std), so the std of [1, 3] is 1
    adv = flow_grpo_advantages(r, 2, global_std=False, eps=0.0)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    # with flow-GRPO's eps the divisor is std + 1e-4
    adv = flow_grpo_advantages(r, 2)
    assert adv.tolist() == pytest.approx([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0], rel=1e-7)
    # global std: the batch's population std, sqrt(((-5)^2 + (-3)^2 + 4^2 + 4^2) / 4) = sqrt(16.5)
    adv = flow_grpo_advantages(r, 2, global_std=True, eps=0.0)
    std = math.sqrt(16.5)
    assert adv.tolist() == pytest.approx([-1 / std, 1 / std, 0.0, 0.0], rel=1e-7)
    assert flow_grpo_advantages(r * 100, 2, eps=0.0, clip=0.5).tolist() == pytest.approx(
        [-0.5, 0.5, 0.0, 0.0]
    )
    with pytest.raises(ValueError, match="G = 3"):
        flow_grpo_advantages(r, 3)


def test_per_prompt_advantages_groups_of_different_sizes():
    # prompt 7 has three images [0, 0, 3] (mean 1, population std sqrt(6/3) = sqrt(2)),
    # prompt 2 has two [2, 4] (mean 3, std 1); interleaved, as flow_grpo groups by prompt text
    r = torch.tensor([0.0, 2.0, 0.0, 4.0, 3.0])
    ids = torch.tensor([7, 2, 7, 2, 7])
    adv = flow_grpo_advantages(r, group_ids=ids, eps=0.0)
    s2 = math.sqrt(2)
    assert adv.tolist() == pytest.approx([-1 / s2, -1.0, -1 / s2, 1.0, 2 / s2], rel=1e-7)
    # global std over every reward: mean 1.8, population variance (3.24+0.04+3.24+4.84+1.44)/5
    g = math.sqrt(12.8 / 5)
    adv = flow_grpo_advantages(r, group_ids=ids, global_std=True, eps=1e-4)
    assert adv.tolist() == pytest.approx(
        [-1 / (g + 1e-4), -1 / (g + 1e-4), -1 / (g + 1e-4), 1 / (g + 1e-4), 2 / (g + 1e-4)], rel=1e-7
    )
    # a group of one image has no spread: advantage 0 (flow_grpo: 0 / (0 + 1e-4))
    assert flow_grpo_advantages(torch.tensor([5.0]), group_ids=torch.tensor([0])).tolist() == [0.0]


def test_per_prompt_advantages_float64_like_numpy():
    # float32 would lose these: rewards 1e8 + {0, 1} differ in the last float32 ulp of the mean
    r = torch.tensor([1e8, 1e8 + 1.0], dtype=torch.float64)
    adv = flow_grpo_advantages(r, 2, eps=0.0)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [-1.0, 1.0]


def test_clipped_step_loss():
    lp = torch.tensor([0.0, 0.0, 0.3], requires_grad=True)
    old = torch.tensor([0.0, -0.1, 0.0])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, ratio = clipped_step_loss(lp, old, adv, clip_range=0.05)
    # row 0: ratio 1 -> -1; row 1: ratio e^0.1 > 1.05 with A > 0 -> clipped at -1.05;
    # row 2: ratio e^0.3 with A < 0 -> unclipped e^0.3 (the max of the two)
    expected = (-1.0 - 1.05 + math.exp(0.3)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1 / 3, 0.0, math.exp(0.3) / 3], abs=1e-6)
    assert ratio.tolist() == pytest.approx([1.0, math.exp(0.1), math.exp(0.3)])
