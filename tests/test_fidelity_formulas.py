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
from mmrl.algos.losses import get_policy_loss


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


# ---------------------------------------------------------------------------------------------
# Issue 36: the last GRPO-family differences from veRL and TRL. Each reference formula is quoted
# (veRL `verl/trainer/ppo/core_algos.py` and `rollout_corr_helper.py` of January 2026; TRL
# `trl/trainer/grpo_trainer.py` `_compute_loss` of July 2026) and worked by hand or by a
# token-level transcription written here from the quoted definition.


def _verl_masked_whiten_outcome(rewards: list[float], lengths: list[int]) -> list[float]:
    """veRL's REINFORCE++ with an outcome reward, gamma = 1, from its definition: every token
    t < L_i of response i carries the return r_i; masked_whiten over the token mask:
    mean = sum(m x) / (sum(m) + 1e-8); var = sum(m (x - mean)^2) / (sum(m) + 1e-8) * T / (T - 1);
    A = (x - mean) * rsqrt(var + 1e-8). Returns each response's (constant) token advantage."""
    width = max(lengths)
    x = torch.tensor([[r] * width for r in rewards], dtype=torch.float64)
    m = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    total = m.sum()
    mean = (x * m).sum() / (total + 1e-8)
    var = ((x - mean) ** 2 * m).sum() / (total + 1e-8) * total / (total - 1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return [whitened[i, 0].item() for i in range(len(rewards))]


def test_reinforce_pp_whitens_per_token_like_verl():
    # Parity 1. Rewards [1, 0, 0.5, 0] with 1, 4, 2, 3 tokens (T = 10):
    # mu = (1*1 + 0.5*2) / 10 = 0.2; deviations 0.8, -0.2, 0.3, -0.2;
    # var = (0.64 + 4*0.04 + 2*0.09 + 3*0.04) / 10 * 10/9 = 1.1 / 9.
    r = torch.tensor([1.0, 0.0, 0.5, 0.0])
    counts = torch.tensor([1, 4, 2, 3])
    adv = get_advantage_estimator("reinforce_pp")(r, 2, token_counts=counts)
    s = math.sqrt(1.1 / 9 + 1e-8)
    assert adv.tolist() == pytest.approx([0.8 / s, -0.2 / s, 0.3 / s, -0.2 / s], rel=1e-6, abs=1e-6)
    assert adv.tolist() == pytest.approx(_verl_masked_whiten_outcome(r.tolist(), counts.tolist()), abs=1e-6)
    # Per response (the earlier mmrl form) would have mu = 0.375: a different advantage.
    per_response = (r - r.mean()) / r.std()
    assert (adv - per_response).abs().max().item() > 0.1


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_pp_matches_verl_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 5, (12,), generator=g).float() / 4
    counts = torch.randint(1, 40, (12,), generator=g)
    adv = get_advantage_estimator("reinforce_pp")(r, 4, token_counts=counts)
    assert adv.tolist() == pytest.approx(_verl_masked_whiten_outcome(r.tolist(), counts.tolist()), abs=1e-6)


def test_the_trainer_hands_reinforce_pp_its_token_counts():
    from mmrl.algos.advantages import TOKEN_WEIGHTED

    assert "reinforce_pp" in TOKEN_WEIGHTED


def test_gspo_clamps_the_sequence_log_ratio_above_at_10_like_verl():
    # Parity 2. veRL: log_seq_importance_ratio = clamp(log_prob - sg(log_prob) + sg(seq_mean), max=10).
    # One response, 2 tokens, mean log-ratio 12, A = -1 (so PPO's clip never binds: the loss
    # is -A s = s). veRL: s = e^10 per token, loss (seq-mean-token-mean) e^10 and no gradient.
    old = torch.zeros(1, 2)
    lp = torch.tensor([[12.0, 12.0]], requires_grad=True)
    loss, _ = get_policy_loss("gspo")(
        lp,
        old,
        torch.tensor([-1.0]),
        torch.ones(1, 2),
        clip_low=0.2,
        clip_high=0.2,
        agg="seq_mean_token_mean",
    )
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)
    assert lp.grad.abs().max().item() == 0.0
    # Below, veRL does not clamp: mean log-ratio -25 still sends the gradient -A s / 2 per token
    # (A = 1: PPO's clip binds for a falling ratio only with A < 0, so A = 1 keeps loss1 = -s).
    lp = torch.tensor([[-25.0, -25.0]], requires_grad=True)
    loss, _ = get_policy_loss("gspo")(
        lp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=1.0, clip_high=0.2, agg="seq_mean_token_mean"
    )
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(-25.0), rel=1e-5)
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(-25.0) / 2] * 2, rel=1e-5)
    # Between 10 and 20 (where mmrl used to clamp at 20) the two differ by e^10: 12 -> e^10, not e^12.


def _loss_and_grad(name: str, lp_values: list[list[float]], adv: list[float], **kw) -> tuple[float, float]:
    """Loss and the gradient of the first token."""
    lp = torch.tensor(lp_values, requires_grad=True)
    loss, _ = get_policy_loss(name)(
        lp, torch.zeros_like(lp), torch.tensor(adv), torch.ones_like(lp), clip_low=0.2, clip_high=0.2, **kw
    )
    loss.backward()
    return loss.item(), lp.grad[0, 0].item()


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_losses_clamp_log_r_at_20_unlike_verl_as_documented(name):
    # Parity 3 (kept, documented): veRL's Clip-Cov and KL-Cov take ratio = exp(log_prob - old)
    # without a clamp; mmrl clamps log r to +-20 (`LOG_RATIO_CLAMP`). cov_ratio tiny and the
    # covariance band empty so that only the ratio term is left: with A < 0 and log r > 0 the
    # loss is -A r (PPO's unclipped side), whose gradient in log r is -A r.
    options = {"cov_ratio": 1e-9}
    if name == "clip_cov":
        options.update(cov_lb=1e9, cov_ub=2e9)  # no candidates
    else:
        options.update(kl_coef=0.0)  # the penalty off: the ratio term alone
    # Inside +-20 the two agree: log r = 5, A = -1 -> loss e^5, gradient e^5 (one token).
    loss, grad = _loss_and_grad(name, [[5.0]], [-1.0], **options)
    assert loss == pytest.approx(math.exp(5.0), rel=1e-6) and grad == pytest.approx(math.exp(5.0), rel=1e-6)
    # At log r = 25 veRL's loss is e^25 with gradient e^25; here the ratio is e^20 and constant.
    loss, grad = _loss_and_grad(name, [[25.0]], [-1.0], **options)
    assert loss == pytest.approx(math.exp(20.0), rel=1e-6)
    assert grad == 0.0
    doc = get_policy_loss(name).__doc__
    assert "Deviation from veRL" in doc and "+-20" in doc


def test_sequence_level_cispo_has_no_lower_bound_like_trl():
    # Parity 4. TRL (loss_type="cispo", importance_sampling_level="sequence"):
    #   coef_1 = exp(mean_t log_ratio); per_token_loss = -clamp(coef_1, max=epsilon_high).detach() * A * logp;
    #   loss = sum(per_token_loss * mask) / num_items (tokens).
    # Log-ratios [-20, 0, 0, 0] (s = e^-5), A = 1, every log-prob -6 (old = log-prob - log-ratio):
    # TRL: e^-5 * 6 = 0.0404; mmrl's earlier floor at 1 - clip_low = 0.8 gave 4.8.
    lp = torch.full((1, 4), -6.0, requires_grad=True)
    old = lp.detach() - torch.tensor([[-20.0, 0.0, 0.0, 0.0]])
    args = (lp, old, torch.tensor([1.0]), torch.ones(1, 4))
    loss, metrics = get_policy_loss("cispo_seq")(*args, clip_low=0.2, clip_high=4.0)
    assert loss.item() == pytest.approx(6 * math.exp(-5.0), rel=1e-6)
    assert round(loss.item(), 4) == 0.0404
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(-5.0) / 4] * 4, rel=1e-6)
    assert metrics["clip_frac_low"] == 0.0
    # The upper bound is TRL's epsilon_high = 1 + clip_high: s = e^2 -> 5 with clip_high 4.
    up = torch.full((1, 2), -1.0)
    loss, _ = get_policy_loss("cispo_seq")(
        up, up - 2.0, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=4.0
    )
    assert loss.item() == pytest.approx(5.0, rel=1e-6)
    # mmrl's earlier floor is kept as an option (algo.cispo_seq_floor=true).
    floored, metrics = get_policy_loss("cispo_seq")(*args, clip_low=0.2, clip_high=4.0, floor=True)
    assert floored.item() == pytest.approx(4.8, rel=1e-6)
    assert metrics["clip_frac_low"] == 1.0


def test_cispo_seq_floor_reaches_the_loss_from_the_config():
    from mmrl.algos.losses import loss_options
    from mmrl.config import load_config

    cfg = load_config(overrides=["algo.policy_loss=cispo_seq", "algo.clip_low=0.2"])
    assert loss_options(cfg.algo) == {}
    cfg = load_config(overrides=["algo.policy_loss=cispo_seq", "algo.cispo_seq_floor=true"])
    assert loss_options(cfg.algo) == {"floor": True}


def test_grpo_passk_is_verls():
    # Parity 6. veRL `compute_grpo_passk_outcome_advantage`: per group, only the best response
    # gets (r_max - r_second_max) / (std + eps) (torch.std: unbiased). veRL's case [0, 0, 1, 0]:
    # std = sqrt(0.25 * 4 / 3 * 3/4)... = 0.5, so the best gets 1 / 0.5 = 2.
    est = get_advantage_estimator("grpo_passk")
    assert est(torch.tensor([0.0, 0.0, 1.0, 0.0]), 4, eps=0.0).tolist() == pytest.approx([0, 0, 2, 0])
    # mmrl's `pass_at_k` is a different estimator (every response gets an advantage).
    other = get_advantage_estimator("pass_at_k")(torch.tensor([0.0, 0.0, 1.0, 0.0]), 4, k=2)
    assert (other != 0).all()
    # Graded rewards: [0.5, 0.2, 0.9, 0.1]: best 0.9, runner-up 0.5, unbiased std of the group
    # (mean 0.425; squares 0.005625 + 0.050625 + 0.225625 + 0.105625 = 0.3875; / 3).
    std = math.sqrt(0.3875 / 3)
    got = est(torch.tensor([0.5, 0.2, 0.9, 0.1, 1.0, 1.0, 0.0, 0.0]), 4)
    assert got.tolist() == pytest.approx([0, 0, 0.4 / (std + 1e-6), 0, 0, 0, 0, 0], rel=1e-6)
    # A tie for the best: margin 0 (veRL's topk gives r_max == r_second), so the whole group is 0.
    # An invalid row is neither best nor runner-up, and leaves the std.
    valid = torch.tensor([True, True, False, True])
    got = est(torch.tensor([0.0, 1.0, 5.0, 0.0]), 4, valid=valid)
    std = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)
    assert got.tolist() == pytest.approx([0, 1 / (std + 1e-6), 0, 0], rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 responses"):
        est(torch.tensor([1.0, 0.0]), 1)


def test_grpo_passk_config():
    from mmrl.config import load_config

    assert load_config(overrides=["algo.advantage=grpo_passk"]).algo.advantage == "grpo_passk"
    with pytest.raises(ValueError, match="grpo_passk needs rollout.group_size >= 2"):
        load_config(overrides=["algo.advantage=grpo_passk", "rollout.group_size=1"])


def _is_inputs(overrides: list[str]):
    """A config, a two-row batch and its StepInputs filled by the trainer's step (b-e)."""
    from mmrl.config import load_config
    from mmrl.router import RewardBatch
    from mmrl.train.grpo import StepInputs
    from mmrl.types import RolloutBatch, VerifierResult

    cfg = load_config(
        overrides=["rollout.group_size=2", "trainer.prompts_per_step=1", "algo.tis=token", *overrides]
    )
    # Row 0: trainer/rollout log-ratio 0 (weight 1); row 1: 1.5 (weight e^1.5 = 4.48, out of the band).
    old = torch.tensor([[0.0, 0.0], [1.5, 1.5]])
    batch = RolloutBatch(
        samples=[],
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.zeros(2, 2, dtype=torch.long),
        response_mask=torch.ones(2, 2, dtype=torch.long),
        rollout_logprobs=torch.zeros(2, 2),
        vision_inputs={},
        texts=["", ""],
        truncated=torch.zeros(2, dtype=torch.bool),
        group_size=2,
    )
    inputs = StepInputs.empty(2, old.clone(), None, tis=True, rejection=cfg.algo.rejection != "off")
    rewards = RewardBatch(results=[VerifierResult(1.0), VerifierResult(0.0)], scores=torch.tensor([1.0, 0.0]))
    inputs.fill(cfg, batch, [0, 1], rewards)
    inputs.normalize_weights(cfg, batch)
    return inputs


def test_is_batch_normalisation_in_verls_order():
    # Parity 5. veRL (`compute_rollout_correction_weights`, then `compute_rollout_rejection_mask`):
    # the IS weights are truncated at the cap and divided by their masked mean over the response
    # mask *before* rejection; rejection then changes the loss mask only. Rows [0, 0] and
    # [1.5, 1.5] (log-ratios), band (0.5, 2), cap 2: weights [1, 1] and [2, 2] (truncated), mean
    # 1.5, so the kept row gets 1 / 1.5 = 0.667; mmrl's earlier order (after rejection) gave 1.
    band = ["algo.rejection=max_token", "algo.rejection_low=0.5", "algo.rejection_high=2.0"]
    inputs = _is_inputs([*band, "algo.tis_cap=2.0", "algo.tis_batch_norm=true"])
    assert inputs.rejected.tolist() == [False, True]
    assert inputs.weights[0].tolist() == pytest.approx([2 / 3, 2 / 3], rel=1e-6)
    assert inputs.weights[1].tolist() == [0.0, 0.0]
    # The same through IcePop's band (token masking in the IS weights, veRL's token_k1 rejection):
    # the masked zeros do not count in the mean either.
    inputs = _is_inputs(
        ["algo.tis_mode=band", "algo.tis_low=0.5", "algo.tis_cap=2.0", "algo.tis_batch_norm=true"]
    )
    assert inputs.weights[0].tolist() == pytest.approx([2 / 3, 2 / 3], rel=1e-6)
    # mmrl's earlier order stays an option: the applied weights average 1 over the loss mask
    # left after rejection (band-masked tokens stay in it with weight 0, and count).
    inputs = _is_inputs(
        [*band, "algo.tis_cap=2.0", "algo.tis_batch_norm=true", "algo.tis_batch_norm_scope=kept"]
    )
    assert inputs.weights[0].tolist() == pytest.approx([1.0, 1.0], rel=1e-6)
    inputs = _is_inputs(
        ["algo.tis_mode=band", "algo.tis_low=0.5", "algo.tis_cap=2.0", "algo.tis_batch_norm=true",
         "algo.tis_batch_norm_scope=kept"]
    )  # fmt: skip
    assert inputs.weights[0].tolist() == pytest.approx([2.0, 2.0], rel=1e-6)


def test_is_batch_normalisation_statistics_by_hand():
    from mmrl.algos.stability import batch_normalize_weights

    w = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    stat = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    normed, factor = batch_normalize_weights(w, mask, "token", stat_weights=stat, stat_mask=torch.ones(2, 2))
    assert factor == pytest.approx(1.5) and normed[0].tolist() == pytest.approx([2 / 3, 2 / 3])
    normed, factor = batch_normalize_weights(
        w, mask, "sequence", stat_weights=stat, stat_mask=torch.ones(2, 2)
    )
    assert factor == pytest.approx(1.5)
    with pytest.raises(ValueError, match="stat_weights"):
        batch_normalize_weights(w, mask, stat_weights=torch.ones(3, 2))
