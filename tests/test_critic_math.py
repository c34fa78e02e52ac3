"""GAE, the clipped value loss and turn-level credit (`mmrl.algos.critic`) against hand-worked
numbers and against straightforward per-element loops written from veRL's and VAGEN's formulas.

Float64 wherever exactness matters. The 3-turn trajectory used by the last tests (13 positions):

    position  0    1    2  | 3    4  | 5    6  | 7  | 8    9    10 | 11   12
    mask      1    1    1  | 0    0  | 1    1  | 0  | 1    1    1  | 0    0
              turn 1         obs       turn 2    obs  turn 3         padding
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algos.advantages import get_advantage_estimator
from mmrl.algos.critic import (
    gae_advantages_returns,
    place_turn_rewards,
    turn_end_mask,
    turn_level_gae,
    turn_returns,
    turn_spans,
    value_loss,
)
from mmrl.algos.losses import get_policy_loss

F64 = torch.float64


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------
# Independent references: plain Python loops over floats, one element at a time


def ref_verl_gae(rewards, values, mask, gamma, lam):
    """veRL's compute_gae_advantage_return before whitening, one row and one position at a time:
    a masked-out position keeps the carried next value and the carried advantage."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask):
        next_value, last = 0.0, 0.0
        row = [0.0] * len(r)
        for t in reversed(range(len(r))):
            delta = r[t] + gamma * next_value - v[t]
            candidate = delta + gamma * lam * last
            next_value = v[t] * m[t] + (1 - m[t]) * next_value
            last = candidate * m[t] + (1 - m[t]) * last
            row[t] = last
        advs.append(row)
        rets.append([a + x for a, x in zip(row, v)])
    return advs, rets


def ref_verl_whiten(x, mask):
    """veRL's masked_whiten (mean and variance over the masked entries of the whole batch)."""
    picked = [a for row, mrow in zip(x, mask) for a, m in zip(row, mrow) if m]
    n = len(picked)
    mean = sum(picked) / (n + 1e-8)
    var = sum((a - mean) ** 2 for a in picked) / (n + 1e-8) * n / (n - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in x]


def ref_vagen_bilevel(rewards, values, mask, gamma, lam, high_gamma):
    """VAGEN's compute_bi_level_gae_advantage_return before whitening, row by row: the turn ends
    are the last 1 of each run in the mask; returns and advantages are 0 off the mask."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask):
        n = len(r)
        ends = [t for t in range(n) if m[t] and (t + 1 == n or not m[t + 1])]
        adv, ret, updated = [0.0] * n, [0.0] * n, list(r)
        last = 0.0
        for i in reversed(range(len(ends))):
            nv = v[ends[i + 1]] if i + 1 < len(ends) else 0.0
            delta = updated[ends[i]] + high_gamma * nv - v[ends[i]]
            last = delta + high_gamma * lam * last
            adv[ends[i]] = last
        for e in ends:
            updated[e] = adv[e] + v[e]
        valid = [t for t in range(n) if m[t]]
        last = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            if t in ends:
                nv, last = 0.0, 0.0
            else:
                nv = v[valid[i + 1]]
            delta = updated[t] + gamma * nv - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
            ret[t] = last + v[t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def random_batch(seed: int, b: int = 5, r: int = 17):
    """Rewards, values and a mask with several turns per row, observation holes and padding."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, r, generator=g, dtype=F64)
    values = torch.randn(b, r, generator=g, dtype=F64)
    mask = (torch.rand(b, r, generator=g) < 0.65).to(F64)
    mask[:, -2:] = 0.0  # padding
    mask[0] = 0.0
    mask[0, 3:9] = 1.0  # one row with a single turn
    mask[1, -1] = 1.0  # one row whose last turn ends at the last position
    return rewards, values, mask


# ---------------------------------------------------------------------------------------------
# Token-level GAE (veRL)


def test_gae_single_turn_by_hand():
    # gamma 0.9, lam 0.8 (gamma lam = 0.72); position 3 is padding (its reward and value unused):
    #   t=2: delta = 1 + 0.9*0 - 0.6 = 0.4                 A = 0.4
    #   t=1: delta = 0 + 0.9*0.6 - 0.4 = 0.14              A = 0.14 + 0.72*0.4 = 0.428
    #   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14             A = -0.14 + 0.72*0.428 = 0.16816
    rewards = t64([[0.0, 0.0, 1.0, 7.0]])
    values = t64([[0.5, 0.4, 0.6, 3.0]])
    mask = t64([[1, 1, 1, 0]])
    adv, ret = gae_advantages_returns(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, t64([[0.16816, 0.428, 0.4, 0.0]]), rtol=0, atol=1e-12)
    # returns = A + V on the mask; on the padding veRL's carried A (0 here) + its value, kept.
    torch.testing.assert_close(ret, t64([[0.66816, 0.828, 1.0, 3.0]]), rtol=0, atol=1e-12)


def test_gae_skips_observation_tokens_by_hand():
    # Turn 1 at 0-1, observation at 2-3 (junk rewards and values), turn 2 at 4-5, padding at 6.
    # gamma 0.5, lam 0.5 (gamma lam = 0.25):
    #   t=5: delta = 2 + 0 - 4 = -2                         A5 = -2
    #   t=4: delta = 0 + 0.5*4 - 3 = -1                     A4 = -1 + 0.25*(-2) = -1.5
    #   t=1: delta = 1 + 0.5*V4 - 2 = 1 + 1.5 - 2 = 0.5     A1 = 0.5 + 0.25*(-1.5) = 0.125
    #        (the next value is V4, across the observation, not the observation's 50 or 60)
    #   t=0: delta = 0 + 0.5*2 - 1 = 0                      A0 = 0.25*0.125 = 0.03125
    rewards = t64([[0.0, 1.0, 9.0, 9.0, 0.0, 2.0, 9.0]])
    values = t64([[1.0, 2.0, 50.0, 60.0, 3.0, 4.0, 70.0]])
    mask = t64([[1, 1, 0, 0, 1, 1, 0]])
    adv, ret = gae_advantages_returns(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, t64([[0.03125, 0.125, 0, 0, -1.5, -2.0, 0]]), rtol=0, atol=1e-12)
    # Off the mask veRL's returns carry the next model token's A: 50 - 1.5, 60 - 1.5, 70 + 0.
    torch.testing.assert_close(ret, t64([[1.03125, 2.125, 48.5, 58.5, 1.5, 2.0, 70.0]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_the_per_element_loop(seed):
    rewards, values, mask = random_batch(seed)
    adv, ret = gae_advantages_returns(rewards, values, mask, gamma=0.97, lam=0.9, whiten=False)
    ref_adv, ref_ret = ref_verl_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    torch.testing.assert_close(adv, t64(ref_adv) * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t64(ref_ret), rtol=0, atol=1e-12)  # every position
    whitened, ret2 = gae_advantages_returns(rewards, values, mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(
        whitened, t64(ref_verl_whiten(ref_adv, mask.tolist())) * mask, rtol=1e-10, atol=1e-12
    )
    assert torch.equal(ret2, ret)  # returns are never whitened
    assert (whitened[mask == 0] == 0).all()


def test_gae_whitening_by_hand():
    # The raw advantages of test_gae_skips_observation_tokens_by_hand on its 4 model tokens:
    # x = [0.03125, 0.125, -1.5, -2], n = 4.
    #   mean = -3.34375 / (4 + 1e-8)
    #   var  = sum (x - mean)^2 / (4 + 1e-8) * 4 / 3
    x = [0.03125, 0.125, -1.5, -2.0]
    mean = sum(x) / (4 + 1e-8)
    var = sum((a - mean) ** 2 for a in x) / (4 + 1e-8) * 4 / 3
    expected = [(a - mean) / math.sqrt(var + 1e-8) for a in x]
    rewards = t64([[0.0, 1.0, 9.0, 9.0, 0.0, 2.0, 9.0]])
    values = t64([[1.0, 2.0, 50.0, 60.0, 3.0, 4.0, 70.0]])
    mask = t64([[1, 1, 0, 0, 1, 1, 0]])
    adv, _ = gae_advantages_returns(rewards, values, mask, gamma=0.5, lam=0.5)
    e = expected
    torch.testing.assert_close(adv, t64([[e[0], e[1], 0, 0, e[2], e[3], 0]]), rtol=1e-12, atol=1e-12)
    # By hand: mean -0.83594, var 3.47144 / 3 = 1.15715, std 1.07571, so
    # (0.03125 + 0.83594) / 1.07571 = 0.8062 and (-2 + 0.83594) / 1.07571 = -1.0821.
    assert adv[0, 0].item() == pytest.approx(0.8062, abs=1e-4) and adv[0, 5].item() == pytest.approx(
        -1.0821, abs=1e-4
    )


def test_gae_degenerate_batches_have_zero_advantage():
    # One model token in the batch (veRL's whitening would raise), or all advantages equal.
    one = gae_advantages_returns(t64([[1.0, 0.0]]), t64([[0.5, 0.0]]), t64([[1, 0]]), 1.0, 1.0)
    assert one[0].tolist() == [[0.0, 0.0]] and one[1].tolist() == [[1.0, 0.0]]
    same = gae_advantages_returns(t64([[1.0], [1.0]]), t64([[0.0], [0.0]]), t64([[1], [1]]), 1.0, 1.0)
    assert same[0].tolist() == [[0.0], [0.0]]


def test_gae_dtype_device_and_masks_of_any_dtype():
    rewards, values, mask = random_batch(3)
    a64, r64 = gae_advantages_returns(rewards, values, mask, 0.99, 0.95)
    a32, r32 = gae_advantages_returns(rewards.float(), values.float(), mask.bool(), 0.99, 0.95)
    assert a32.dtype == r32.dtype == torch.float32 and a32.device == rewards.device
    torch.testing.assert_close(a32, a64.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r32, r64.float(), rtol=1e-5, atol=1e-5)
    a_int, _ = gae_advantages_returns(rewards, values, mask.long(), 0.99, 0.95)
    assert torch.equal(a_int, a64)
    with pytest.raises(ValueError, match="values has shape"):
        gae_advantages_returns(rewards, values[:, :-1], mask, 0.99, 0.95)


# ---------------------------------------------------------------------------------------------
# The clipped value loss (veRL)


def _value_case():
    # c = 0.5. Token 0: inside the clip range [0.7, 1.7]: both errors (1 - 2)^2 = 1.
    # Token 1: V_old 1, vpred 2 -> clipped to 1.5; R = 3: unclipped 1, clipped 2.25 -> 2.25 (clipped).
    # Token 2: V_old 0.5, vpred -0.5 -> clipped to 0; R = 0: unclipped 0.25, clipped 0 -> 0.25.
    # Token 3: masked out (junk).
    vpreds = t64([[1.0, 2.0, -0.5, 5.0]]).requires_grad_()
    values = t64([[1.2, 1.0, 0.5, 0.0]])
    returns = t64([[2.0, 3.0, 0.0, 9.0]])
    mask = t64([[1, 1, 1, 0]])
    return vpreds, returns, values, mask


def test_value_loss_value_clipfrac_and_gradients_by_hand():
    vpreds, returns, values, mask = _value_case()
    loss, clipfrac = value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # 0.5 * (1 + 2.25 + 0.25) / 3 tokens
    assert loss.item() == pytest.approx(0.5 * 3.5 / 3, abs=1e-12)
    assert clipfrac.item() == pytest.approx(1 / 3, abs=1e-7)  # token 1 only
    assert not clipfrac.requires_grad
    loss.backward()
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3 on the unclipped branch: token 0 (1 - 2) / 3,
    # token 2 (-0.5 - 0) / 3; token 1 takes the clipped branch, constant in v: 0; token 3 masked.
    torch.testing.assert_close(vpreds.grad, t64([[-1 / 3, 0.0, -0.5 / 3, 0.0]]), rtol=0, atol=1e-12)


def test_value_loss_equals_the_per_element_formula():
    g = torch.Generator().manual_seed(5)
    vpreds = torch.randn(4, 9, generator=g, dtype=F64).requires_grad_()
    values = torch.randn(4, 9, generator=g, dtype=F64)
    returns = torch.randn(4, 9, generator=g, dtype=F64)
    mask = (torch.rand(4, 9, generator=g) < 0.7).to(F64)
    c = 0.3
    loss, clipfrac = value_loss(vpreds, returns, values, mask, c)
    loss.backward()
    total, n, clipped, grads = 0.0, 0, 0, []
    for vp, v, r, m in zip(vpreds.tolist(), values.tolist(), returns.tolist(), mask.tolist()):
        row = []
        for a, b, ret, keep in zip(vp, v, r, m):
            clip = min(max(a, b - c), b + c)
            e1, e2 = (a - ret) ** 2, (clip - ret) ** 2
            if keep:
                total, n, clipped = total + max(e1, e2), n + 1, clipped + (e2 > e1)
            # The unclipped error carries the gradient where it is the larger; inside the clip
            # range the two are equal and the clipped one moves with vpred too (their halves of
            # torch.maximum's gradient add up to the whole). Times 0.5 * 2 / n below.
            row.append((a - ret) if keep and e1 >= e2 else 0.0)
        grads.append(row)
    assert 0 < clipped < n  # both branches are exercised
    assert loss.item() == pytest.approx(0.5 * total / n, rel=1e-12)
    assert clipfrac.item() == pytest.approx(clipped / n, abs=1e-7)
    torch.testing.assert_close(vpreds.grad, t64(grads) / n, rtol=1e-12, atol=1e-12)


def test_value_loss_aggregations():
    # Row 0: errors (0 - 1)^2 = 1 and (0 - 3)^2 = 9 (no clipping: vpreds = values); row 1: 4.
    vpreds = t64([[0.0, 0.0], [0.0, 0.0]])
    returns = t64([[1.0, 3.0], [2.0, 7.0]])
    mask = t64([[1, 1], [1, 0]])
    token, _ = value_loss(vpreds, returns, vpreds, mask, 0.2)
    assert token.item() == pytest.approx(0.5 * (1 + 9 + 4) / 3)
    seq, _ = value_loss(vpreds, returns, vpreds, mask, 0.2, loss_agg_mode="seq-mean-token-mean")
    assert seq.item() == pytest.approx(0.5 * ((1 + 9) / 2 + 4 / 1) / 2)
    same, _ = value_loss(vpreds, returns, vpreds, mask, 0.2, loss_agg_mode="seq_mean_token_mean")
    assert same.item() == seq.item()
    norm, _ = value_loss(
        vpreds, returns, vpreds, mask, 0.2, loss_agg_mode="seq-mean-token-sum-norm", max_len=4
    )
    assert norm.item() == pytest.approx(0.5 * (10 / 4 + 4 / 4) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        value_loss(vpreds, returns, vpreds, mask, 0.2, loss_agg_mode="seq-mean-token-sum")
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(vpreds, returns, vpreds, mask, 0.0)


# ---------------------------------------------------------------------------------------------
# Turns


def test_turn_returns_by_hand():
    # gamma 0.5: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
    assert turn_returns(t64([1.0, 0.0, 2.0]), 0.5).tolist() == [1.5, 1.0, 2.0]
    # gamma 1: the rest of the episode's return; gamma 0: each turn's own reward.
    assert turn_returns(t64([[1.0, 2.0, 3.0]]), 1.0).tolist() == [[6.0, 5.0, 3.0]]
    assert turn_returns(t64([[1.0, 2.0, 3.0]]), 0.0).tolist() == [[1.0, 2.0, 3.0]]
    # Row 0 has 2 real turns: its third column (5) is padding and reaches no turn.
    # Row 1: G = [1 + 0.9 * (1 + 0.9 * 1), 1 + 0.9 * 1, 1] = [2.71, 1.9, 1].
    out = turn_returns(t64([[1.0, 2.0, 5.0], [1.0, 1.0, 1.0]]), 0.9, num_turns=torch.tensor([2, 3]))
    torch.testing.assert_close(out, t64([[1.0 + 0.9 * 2.0, 2.0, 0.0], [2.71, 1.9, 1.0]]), rtol=0, atol=1e-12)
    assert out.dtype == F64
    assert turn_returns(torch.tensor([[1, 2]]), 1.0).dtype == torch.get_default_dtype()
    with pytest.raises(ValueError, match="num_turns"):
        turn_returns(t64([[1.0, 2.0]]), 1.0, num_turns=torch.tensor([1, 2]))


def test_turn_spans_and_ends():
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0],  # 3 turns, observations between, padding after
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # one turn filling the row
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # nothing
            [0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1],  # single-token turns, a turn at the very end
        ]
    )
    assert turn_spans(mask) == [
        [(0, 3), (5, 7), (8, 11)],
        [(0, 13)],
        [],
        [(1, 2), (3, 4), (5, 6), (11, 13)],
    ]
    assert turn_spans(mask.bool()) == turn_spans(mask.double())
    ends = turn_end_mask(mask)
    assert ends.nonzero().tolist() == [[0, 2], [0, 6], [0, 10], [1, 12], [3, 1], [3, 3], [3, 5], [3, 12]]


def test_place_turn_rewards():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    rewards = place_turn_rewards(t64([[0.1, 0.2, 0.3], [4.0, 0.0, 0.0]]), mask)
    assert rewards.tolist() == [[0, 0.1, 0, 0.2, 0, 0, 0.3, 0], [0, 0, 4.0, 0, 0, 0, 0, 0]]
    assert rewards.dtype == F64
    with pytest.raises(ValueError, match="does not have"):
        place_turn_rewards(t64([[0.1, 0.2, 0.3], [4.0, 1.0, 0.0]]), mask)
    with pytest.raises(ValueError, match="3 turns"):
        place_turn_rewards(t64([[0.1, 0.2], [4.0, 0.0]]), mask)


# ---------------------------------------------------------------------------------------------
# The 3-turn trajectory: trajectory-level GRPO and turn-level GAE, token by token

MASK_3T = [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0]
MODEL = [i for i, m in enumerate(MASK_3T) if m]
# Turn rewards 0, 0.5, 1.0 on the turns' last tokens 2, 6, 10; junk (5.0) on an observation token.
REWARDS_3T = [0, 0, 0.0, 5.0, 0, 0, 0.5, 0, 0, 0, 1.0, 0, 0]
# Critic values on model tokens; junk (9.0) on observation and padding tokens.
VALUES_3T = [0.5, 0.6, 0.7, 9.0, 9.0, 0.4, 0.2, 9.0, 0.3, 0.5, 0.8, 9.0, 9.0]


def test_grpo_gives_every_model_token_its_trajectorys_advantage():
    # A group of 4 trajectories; the first is the 3-turn one, episode return 0 + 0.5 + 1 = 1.5,
    # the others return 0.5, 0 and 1 (one turn each, at tokens 0-4).
    # mean 0.75; unbiased std sqrt((0.75^2 + 0.25^2 + 0.75^2 + 0.25^2) / 3) = sqrt(1.25 / 3).
    episode = torch.tensor([sum(REWARDS_3T) - 5.0, 0.5, 0.0, 1.0])
    adv = get_advantage_estimator("grpo")(episode, 4)
    std = math.sqrt(1.25 / 3)
    expected = [0.75 / (std + 1e-6), -0.25 / (std + 1e-6), -0.75 / (std + 1e-6), 0.25 / (std + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    a0 = expected[0]  # 1.1619

    mask = torch.tensor([MASK_3T] + [[1] * 5 + [0] * 8] * 3, dtype=torch.float32)
    # The advantage each token carries in the policy loss: the row's scalar, masked.
    per_token = adv.unsqueeze(-1) * mask
    assert per_token[0].tolist() == pytest.approx([a0 if m else 0.0 for m in MASK_3T], abs=1e-6)
    # ... and what the loss does with it: at ratio 1 the PPO loss's gradient on a token is
    # -A / (tokens in the batch), so every model token of trajectory 0 gets -a0 / 23 and every
    # observation or padding token exactly 0.
    logprobs = torch.zeros(4, 13, requires_grad=True)
    loss, _ = get_policy_loss("ppo")(logprobs, torch.zeros(4, 13), adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    n = 8 + 3 * 5
    seen = (-logprobs.grad[0] * n).tolist()
    assert seen == pytest.approx([a0 if m else 0.0 for m in MASK_3T], abs=1e-5)
    assert all(logprobs.grad[0, i].item() == 0.0 for i in range(13) if i not in MODEL)


# Hand-worked turn-level GAE of the 3-turn trajectory: Gamma = 0.9 (per turn), gamma = 0.8 (per
# token), lam = 0.5. Turn values are read at the turns' last tokens: V1 = 0.7, V2 = 0.2, V3 = 0.8.
#   Turn level (Gamma lam = 0.45):
#     k=3: delta = 1.0 + 0.9*0 - 0.8 = 0.2                         A3 = 0.2
#     k=2: delta = 0.5 + 0.9*0.8 - 0.2 = 1.02                      A2 = 1.02 + 0.45*0.2 = 1.11
#     k=1: delta = 0.0 + 0.9*0.2 - 0.7 = -0.52                     A1 = -0.52 + 0.45*1.11 = -0.0205
#   Token level (gamma lam = 0.4), each turn's last token takes its turn's A:
#     turn 3: t10 = 0.2;     t9 = (0.8*0.8 - 0.5) + 0.4*0.2 = 0.22;  t8 = (0.8*0.5 - 0.3) + 0.4*0.22 = 0.188
#     turn 2: t6 = 1.11;     t5 = (0.8*0.2 - 0.4) + 0.4*1.11 = 0.204
#     turn 1: t2 = -0.0205;  t1 = (0.8*0.7 - 0.6) + 0.4*(-0.0205) = -0.0482
#                            t0 = (0.8*0.6 - 0.5) + 0.4*(-0.0482) = -0.03928
#   Returns A + V: t0 0.46072, t1 0.5518, t2 0.6795, t5 0.604, t6 1.31, t8 0.488, t9 0.72, t10 1.0
ADV_3T = [-0.03928, -0.0482, -0.0205, 0, 0, 0.204, 1.11, 0, 0.188, 0.22, 0.2, 0, 0]
RET_3T = [0.46072, 0.5518, 0.6795, 0, 0, 0.604, 1.31, 0, 0.488, 0.72, 1.0, 0, 0]


def test_turn_level_gae_three_turns_by_hand():
    rewards, values, mask = t64([REWARDS_3T]), t64([VALUES_3T]), t64([MASK_3T])
    adv, ret = turn_level_gae(rewards, values, mask, gamma=0.8, lam=0.5, high_level_gamma=0.9, whiten=False)
    torch.testing.assert_close(adv, t64([ADV_3T]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t64([RET_3T]), rtol=0, atol=1e-12)
    # Observation and padding tokens: exactly 0, whatever their junk rewards and values.
    assert all(adv[0, i].item() == 0.0 and ret[0, i].item() == 0.0 for i in range(13) if i not in MODEL)

    # The same rewards built from per-turn rewards [B, T].
    placed = place_turn_rewards(t64([[0.0, 0.5, 1.0]]), mask)
    adv2, _ = turn_level_gae(placed, values, mask, gamma=0.8, lam=0.5, high_level_gamma=0.9, whiten=False)
    assert torch.equal(adv2, adv)

    # Whitened (VAGEN's default) over the 8 model tokens; still exactly 0 off them.
    white, ret_w = turn_level_gae(rewards, values, mask, gamma=0.8, lam=0.5, high_level_gamma=0.9)
    x = [ADV_3T[i] for i in MODEL]
    mean = sum(x) / (8 + 1e-8)
    std = math.sqrt(sum((a - mean) ** 2 for a in x) / (8 + 1e-8) * 8 / 7 + 1e-8)
    expected = [(ADV_3T[i] - mean) / std if MASK_3T[i] else 0.0 for i in range(13)]
    torch.testing.assert_close(white, t64([expected]), rtol=1e-10, atol=1e-10)
    assert torch.equal(ret_w, ret)


def test_turn_level_gae_differs_from_grpo_within_a_trajectory():
    # GRPO gives turn 1 and turn 3 of the trajectory the same advantage; turn-level GAE credits
    # turn 2 (which reached the 0.5 reward above its value) most and turn 1 slightly negatively.
    adv, _ = turn_level_gae(
        t64([REWARDS_3T]),
        t64([VALUES_3T]),
        t64([MASK_3T]),
        gamma=0.8,
        lam=0.5,
        high_level_gamma=0.9,
        whiten=False,
    )
    last_tokens = [adv[0, e].item() for e in (2, 6, 10)]
    assert last_tokens == pytest.approx([-0.0205, 1.11, 0.2], abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_level_gae_equals_vagens_per_element_loop(seed):
    rewards, values, mask = random_batch(seed)
    adv, ret = turn_level_gae(rewards, values, mask, gamma=0.95, lam=0.9, high_level_gamma=0.8, whiten=False)
    ref_adv, ref_ret = ref_vagen_bilevel(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.9, 0.8)
    torch.testing.assert_close(adv, t64(ref_adv), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t64(ref_ret), rtol=0, atol=1e-12)
    white, _ = turn_level_gae(rewards, values, mask, gamma=0.95, lam=0.9, high_level_gamma=0.8)
    torch.testing.assert_close(
        white, t64(ref_verl_whiten(ref_adv, mask.tolist())) * mask, rtol=1e-10, atol=1e-12
    )
    assert (white[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_turn_level_gae_single_turn_is_token_gae_toward_the_turn_target():
    # One turn and Gamma irrelevant: the turn's target is r + 0 (nothing after it), so the token
    # level is plain GAE with the reward on the last token: same as veRL's GAE on that row.
    rewards = t64([[0.0, 0.0, 1.0, 0.0]])
    values = t64([[0.5, 0.4, 0.6, 3.0]])
    mask = t64([[1, 1, 1, 0]])
    adv, ret = turn_level_gae(rewards, values, mask, gamma=0.9, lam=0.8, high_level_gamma=0.3, whiten=False)
    torch.testing.assert_close(adv, t64([[0.16816, 0.428, 0.4, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t64([[0.66816, 0.828, 1.0, 0.0]]), rtol=0, atol=1e-12)


def test_turn_level_gae_edge_rows_and_dtypes():
    # A row without model tokens, and a batch with no model token at all.
    rewards, values, mask = random_batch(4)
    mask[2] = 0.0
    adv, ret = turn_level_gae(rewards.float(), values.float(), mask.bool(), 0.99, 0.95, 0.9)
    assert adv.dtype == ret.dtype == torch.float32
    assert (adv[2] == 0).all() and (ret[2] == 0).all()
    a64, _ = turn_level_gae(rewards, values, mask, 0.99, 0.95, 0.9)
    torch.testing.assert_close(adv, a64.float(), rtol=1e-4, atol=1e-5)
    empty = turn_level_gae(t64([[1.0, 2.0]]), t64([[0.5, 0.5]]), t64([[0, 0]]), 1.0, 1.0, 1.0)
    assert empty[0].tolist() == [[0.0, 0.0]] and empty[1].tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="response_mask has shape"):
        turn_level_gae(rewards, values, mask[:, :3], 0.99, 0.95, 0.9)
