"""PPO with a critic: GAE, the clipped value loss, and credit across the turns of a trajectory.

Pure functions over per-token tensors; nothing here knows about models or trainers. Shapes: B
rows (trajectories), R response positions. `response_mask` [B, R] is 1 on the model's own tokens
and 0 elsewhere: observation tokens (tool or environment output put between two turns) and the
padding after the response. A *turn* is a maximal run of 1s in a row of the mask
(`turn_spans`), its last token the turn's *end* (`turn_end_mask`).

| function | what |
|---|---|
| `gae_advantages_returns` | veRL's `compute_gae_advantage_return`: token-level GAE, advantages whitened |
| `value_loss` | veRL's `compute_value_loss`: 0.5 max((V - R)^2, (clip(V) - R)^2), and its clip fraction |
| `turn_returns` | per-turn discounted returns G_k = r_k + gamma G_{k+1} |
| `turn_spans`, `turn_end_mask` | the turns of each row, as (start, end) spans or a mask of their last tokens |
| `place_turn_rewards` | [B, T] per-turn rewards put on each turn's last model token |
| `turn_level_gae` | VAGEN's bi-level GAE: GAE over turns, then over each turn's tokens |

Which to use: trajectory-level GRPO (`mmrl.algos.advantages`, the default) gives every model
token of a trajectory its trajectory's one advantage and needs no critic. With a critic,
`gae_advantages_returns` treats a multi-turn trajectory as one long token MDP (observation
tokens skipped), so a turn's reward reaches earlier turns through gamma^tokens;
`turn_level_gae` discounts across turns by `high_level_gamma` per turn instead, and bootstraps
each turn from the critic's value at the turn's last token.

The advantage functions run under `torch.no_grad()` and compute in the promoted dtype of the
rewards and values (float32 in, float32 out; float64 for exact tests). Their reverse loop is
over positions (as veRL's; `turn_level_gae` adds one over turns), each step a few batched
kernels over the B rows, so a [256, 1024] batch costs ~4,000 small kernel launches on a GPU and
~50 ms on one CPU thread; everything else is vectorised. On the masked tokens the advantages and
returns are bitwise equal to veRL's and VAGEN's own functions (checked in float32 and float64
when this was written; the tests check them against per-element loops).
"""

from __future__ import annotations

import torch

from mmrl.algos.advantages import _token_whiten
from mmrl.algos.losses import aggregate, masked_mean


def _check_same_shape(name: str, ref: str, ref_tensor: torch.Tensor, **others: torch.Tensor) -> None:
    if ref_tensor.dim() != 2:
        raise ValueError(f"{name}: {ref} must be [B, R], got shape {list(ref_tensor.shape)}")
    for what, t in others.items():
        if t.shape != ref_tensor.shape:
            raise ValueError(f"{name}: {what} has shape {list(t.shape)}, {ref} has {list(ref_tensor.shape)}")


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _reverse_gae(
    delta: torch.Tensor, coef: float, active: torch.Tensor, restart: torch.Tensor | None = None
) -> torch.Tensor:
    """The GAE recursion right to left along the last dim of delta [B, L]:

        g_t = delta_t + coef * g_next     where active[:, t]
        g_t = g_next                      elsewhere (carried over unchanged)

    g_next is the g of position t + 1 (0 past the end), or 0 where restart[:, t] (a new
    recursion starts there). Returns g [B, L]; the caller masks what is not active.
    """
    b, length = delta.shape
    g = torch.zeros(b, dtype=delta.dtype, device=delta.device)
    out = torch.empty_like(delta)
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    for t in range(length - 1, -1, -1):
        nxt = g if restart is None else torch.where(restart[:, t], zero, g)
        g = torch.where(active[:, t], delta[:, t] + coef * nxt, g)
        out[:, t] = g
    return out


def _whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """veRL's `masked_whiten` over every masked token of the batch (`_token_whiten`), 0 off it."""
    return _token_whiten(advantages.reshape(-1), mask.reshape(-1), None).view_as(advantages)


# ---------------------------------------------------------------------------------------------
# Token-level GAE and the value loss (veRL)


@torch.no_grad()
def gae_advantages_returns(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over response tokens, as veRL's `compute_gae_advantage_return`
    (volcengine/verl b178a3c, 2026-01-29; the observation-token skip is its PR #2337):

        nv_t    = values at the next masked-in position after t (0 if none)
        delta_t = r_t + gamma nv_t - V_t
        A_t     = delta_t + gamma lam A_next,   A_next: A of the next masked-in position (0 if none)
        returns = A + V                          (before whitening)
        A       = masked_whiten(A, mask)         over every masked token of the batch

    so masked-out positions (observation tokens between turns) are skipped: they neither bootstrap
    a value nor add a TD error, and the recursion runs on from the next model token as if they
    were not there. Rewards on masked-out positions are ignored.

    The whitening is veRL's: mean = sum A / (n + 1e-8), var = sum (A - mean)^2 / (n + 1e-8) *
    n / (n - 1), A = (A - mean) * rsqrt(var + 1e-8), n the masked tokens of the whole batch.

    Where this differs from veRL, it is off the mask or in degenerate batches only:
    - advantages are 0 on masked-out positions (veRL leaves there the whitened advantage of the
      next model token, or -mean / std on the padding; no loss reads them);
    - fewer than two masked tokens, or all their advantages equal, give all-0 advantages (veRL
      raises, or gives ~1e-5 noise), as mmrl's other whitened estimators do.
    `returns` equal veRL's everywhere, masked-out positions included (A + V there, with the
    carried A); mask them in the value loss, as `value_loss` does.

    Args:
        token_level_rewards: [B, R] per-token rewards (an outcome reward on the last model token,
            plus any per-token KL penalty).
        values: [B, R] the critic's values of the rollout (the old values).
        response_mask: [B, R] 1 on model tokens (any dtype; nonzero counts).
        gamma: the discount per model token.
        lam: GAE's lambda.
        whiten: whiten the advantages as veRL does (default); False returns the raw A (still 0
            off the mask), e.g. to whiten over a larger batch later.

    Returns:
        (advantages, returns), each [B, R], in the promoted dtype of rewards and values.
    """
    _check_same_shape(
        "gae_advantages_returns",
        "token_level_rewards",
        token_level_rewards,
        values=values,
        response_mask=response_mask,
    )
    dtype = _float_dtype(token_level_rewards, values)
    r, v = token_level_rewards.to(dtype), values.to(dtype)
    m = response_mask != 0
    b, length = r.shape
    # The next masked-in position after t: a suffix minimum over masked-in indices, shifted by one.
    pos = torch.arange(length, device=r.device).expand(b, length)
    idx = torch.where(m, pos, torch.full_like(pos, length))
    suffix_min = idx.flip(-1).cummin(dim=-1).values.flip(-1)
    nxt = torch.cat([suffix_min[:, 1:], torch.full_like(suffix_min[:, :1], length)], dim=-1)
    v_ext = torch.cat([v, torch.zeros(b, 1, dtype=dtype, device=v.device)], dim=-1)
    next_values = v_ext.gather(1, nxt)
    delta = r + gamma * next_values - v
    raw = _reverse_gae(delta, gamma * lam, m)
    returns = raw + v
    advantages = _whiten(raw, m) if whiten else torch.where(m, raw, torch.zeros_like(raw))
    return advantages, returns


VALUE_AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
"""veRL's spellings of the aggregations `value_loss` takes, to mmrl's (`losses.AGGREGATIONS`)."""


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    denom: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, as veRL's `compute_value_loss` (volcengine/verl b178a3c):

        V_clip = max(min(vpreds, values + c), values - c)          c = cliprange_value
        l_t    = max((vpreds - returns)^2, (V_clip - returns)^2)
        loss   = 0.5 * aggregate(l, mask, agg)
        clipfrac = mean over masked tokens of [(V_clip - R)^2 > (vpreds - R)^2]

    The gradient reaches `vpreds` only (returns and values are detached): vpreds - returns
    (times 0.5 * 2 / the normaliser) where the unclipped error is the larger, and nothing where
    the clipped one is (V_clip is constant beyond values +- c).

    The aggregation is mmrl's `aggregate`, the one the policy losses use (`loss_agg_mode` in
    veRL's spelling or mmrl's): `token-mean` equals veRL's `agg_loss`; `seq-mean-token-mean`
    differs by veRL's + 1e-8 in each row's token count; `seq-mean-token-sum-norm` divides by the
    number of rows times max_len, where veRL's current `agg_loss` divides by max_len alone; veRL's
    `seq-mean-token-sum` is not offered. `clipfrac` divides by the token count, veRL by it +
    1e-8. An empty mask gives loss 0 and clipfrac 0 (veRL: NaN).

    Args:
        vpreds: [B, R] the critic's current values (with grad).
        returns: [B, R] the value targets (`gae_advantages_returns` / `turn_level_gae`).
        values: [B, R] the critic's values at rollout time (the clip is around them).
        response_mask: [B, R] 1 on the tokens in the loss.
        cliprange_value: c > 0.
        loss_agg_mode: `token-mean` (default), `seq-mean-token-mean`, `seq-mean-token-sum-norm`
            (or `token_mean`, ...).
        denom, max_len: as in `aggregate` (micro-batches of one mini-batch: pass every one
            `denom=loss_denominator(minibatch_mask, agg, max_len)`).

    Returns:
        (loss, clipfrac): the scalar loss with grad, and the detached float32 clip fraction.
    """
    _check_same_shape(
        "value_loss", "vpreds", vpreds, returns=returns, values=values, response_mask=response_mask
    )
    if not cliprange_value > 0:
        raise ValueError(f"value_loss: cliprange_value must be > 0, got {cliprange_value}")
    agg = VALUE_AGGREGATIONS.get(loss_agg_mode, loss_agg_mode)
    returns, values = returns.detach(), values.detach()
    clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped_err = (vpreds - returns).square()
    clipped_err = (clipped - returns).square()
    per_token = torch.maximum(unclipped_err, clipped_err)
    loss = 0.5 * aggregate(per_token, response_mask, agg, denom, max_len)
    with torch.no_grad():
        clipfrac = masked_mean(torch.gt(clipped_err, unclipped_err).float(), (response_mask != 0).float())
    return loss, clipfrac


# ---------------------------------------------------------------------------------------------
# Turns


def turn_returns(
    turn_rewards: torch.Tensor, gamma: float, num_turns: torch.Tensor | None = None
) -> torch.Tensor:
    """Discounted returns per turn, along the last dim: G_k = r_k + gamma G_{k+1}, G past the
    last turn 0.

    Args:
        turn_rewards: [..., T] the reward of each turn (e.g. [B, T_max], rows padded on the
            right).
        gamma: the discount per turn (1: the rest of the episode's return).
        num_turns: [...] optional count of real turns per row; turns at index >= it are left out
            (their reward does not reach the real turns) and get 0.

    Returns:
        [..., T] in turn_rewards' float dtype.
    """
    if turn_rewards.dim() < 1:
        raise ValueError("turn_returns: turn_rewards must have a turn dimension, got a scalar")
    r = turn_rewards if turn_rewards.is_floating_point() else turn_rewards.to(torch.get_default_dtype())
    t = r.shape[-1]
    if num_turns is None:
        valid = torch.ones(r.shape, dtype=torch.bool, device=r.device)
    else:
        if num_turns.shape != r.shape[:-1]:
            raise ValueError(
                f"turn_returns: num_turns must be {list(r.shape[:-1])}, got shape {list(num_turns.shape)}"
            )
        k = torch.arange(t, device=r.device)
        valid = k < num_turns.to(r.device).unsqueeze(-1)
    flat_r, flat_v = r.reshape(-1, t), valid.reshape(-1, t)
    out = _reverse_gae(torch.where(flat_v, flat_r, torch.zeros_like(flat_r)), gamma, flat_v)
    return torch.where(flat_v, out, torch.zeros_like(out)).view(r.shape)


def turn_end_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: True on the last model token of each turn (a 1 followed by a 0 or the end)."""
    m = response_mask != 0
    after = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], dim=-1)
    return m & ~after


def turn_spans(response_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The turns of each row as (start, end) token spans, end exclusive (`mask[start:end]` is a
    turn): a turn is a maximal run of 1s; observation tokens and padding (0s) separate them.

    Args:
        response_mask: [B, R] (any dtype; nonzero counts).

    Returns:
        B lists of spans in order (an empty list for a row without model tokens).
    """
    if response_mask.dim() != 2:
        raise ValueError(f"turn_spans: response_mask must be [B, R], got shape {list(response_mask.shape)}")
    m = response_mask != 0
    before = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], dim=-1)
    starts = (m & ~before).nonzero().tolist()  # row-major, so starts and ends pair up in order
    ends = turn_end_mask(m).nonzero().tolist()
    spans: list[list[tuple[int, int]]] = [[] for _ in range(m.shape[0])]
    for (row, start), (_, end) in zip(starts, ends):
        spans[row].append((start, end + 1))
    return spans


def _turn_index(ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position, the index of the turn ending there (k-th end of its row, from 0), and
    the number of turns per row [B]."""
    count = ends.sum(dim=-1)
    return ends.long().cumsum(dim=-1) - 1, count


def place_turn_rewards(turn_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-turn rewards [B, T] as token-level rewards [B, R]: turn k's reward on the last model
    token of the row's k-th turn (VAGEN's layout, which `turn_level_gae` reads), 0 elsewhere.

    Columns past a row's turn count must hold 0 (a reward for a turn the mask does not have is
    an error, as is a row with more turns than T).
    """
    if turn_rewards.dim() != 2 or response_mask.dim() != 2 or turn_rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"place_turn_rewards: turn_rewards [B, T] and response_mask [B, R] needed, got "
            f"{list(turn_rewards.shape)} and {list(response_mask.shape)}"
        )
    ends = turn_end_mask(response_mask)
    k, count = _turn_index(ends)
    t = turn_rewards.shape[1]
    r = turn_rewards.to(response_mask.device)
    if count.numel() and int(count.max()) > t:
        raise ValueError(
            f"place_turn_rewards: a row has {int(count.max())} turns, turn_rewards has {t} columns"
        )
    beyond = torch.arange(t, device=r.device) >= count.unsqueeze(-1)
    if bool((beyond & (r != 0)).any()):
        raise ValueError("place_turn_rewards: a nonzero reward for a turn the response mask does not have")
    picked = r.gather(1, k.clamp(0, max(t - 1, 0))) if t else torch.zeros_like(k, dtype=r.dtype)
    return torch.where(ends, picked, torch.zeros_like(picked))


@torch.no_grad()
def turn_level_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    high_level_gamma: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VAGEN's bi-level GAE for multi-turn trajectories: GAE across turns, then GAE over each
    turn's tokens toward the turn's target, as `compute_bi_level_gae_advantage_return` (the
    `bi_level_gae` estimator of RAGEN-AI/VAGEN d2b8b30, 2025-10-01, in its verl fork
    JamesKrW/verl 3f55021, 2025-07-12):

    Turn k of a row ends at E_k (its last model token, `turn_end_mask`); r_k is the reward there
    and V_k = values[E_k] the critic's value of the turn.

        turn level   delta_k = r_k + Gamma V_{k+1} - V_k        (V after the last turn: 0)
                     A_k     = delta_k + Gamma lam A_{k+1}      (A after the last turn: 0)
                     G_k     = A_k + V_k                         the turn's target
        token level  A_{E_k} = G_k - V_{E_k}                     (= A_k)
                     A_t     = r_t + gamma V_{t+1} - V_t + gamma lam A_{t+1}
                               for the turn's other model tokens t (t + 1 is in the same turn)
        returns_t    = A_t + V_t                                 (before whitening)
        A            = masked_whiten(A, mask)                    over every model token of the batch

    Gamma is `high_level_gamma`; lam is shared by both levels, as in VAGEN. Observation tokens
    and padding have neither a value nor an advantage: their values and rewards are never read,
    and their advantages and returns are exactly 0 (VAGEN's whitening gives them -mean / std;
    no loss reads them). Rewards: VAGEN's layout, the turn's reward on its last model token
    (`place_turn_rewards` makes it from [B, T] per-turn rewards); a reward on another model
    token (a per-token KL penalty) enters the token-level TD error of that token. Turns are the
    mask's maximal runs of 1s (VAGEN reads their ends from a separate end-of-response mask; two
    turns with no observation between them are one turn here).

    Fewer than two model tokens in the batch, or all their advantages equal, give all-0
    advantages (veRL's whitening raises), as `gae_advantages_returns`.

    Args:
        token_level_rewards: [B, R], each turn's reward on its last model token.
        values: [B, R] the critic's values of the rollout.
        response_mask: [B, R] 1 on model tokens (any dtype; nonzero counts).
        gamma: the discount per token inside a turn.
        lam: GAE's lambda, for both levels.
        high_level_gamma: the discount per turn.
        whiten: whiten the advantages over the batch's model tokens (VAGEN's default).

    Returns:
        (advantages, returns), each [B, R], in the promoted dtype of rewards and values.
    """
    _check_same_shape(
        "turn_level_gae",
        "token_level_rewards",
        token_level_rewards,
        values=values,
        response_mask=response_mask,
    )
    dtype = _float_dtype(token_level_rewards, values)
    r, v = token_level_rewards.to(dtype), values.to(dtype)
    m = response_mask != 0
    ends = turn_end_mask(m)
    b, length = r.shape
    k, count = _turn_index(ends)
    n_turns = int(count.max()) if b else 0
    # Turn level, on [B, K] tensors of each turn's reward and value (column K collects the
    # non-end positions and is dropped).
    slot = torch.where(ends, k, torch.full_like(k, n_turns))
    turn_r = torch.zeros(b, n_turns + 1, dtype=dtype, device=r.device).scatter(1, slot, r)[:, :n_turns]
    turn_v = torch.zeros(b, n_turns + 1, dtype=dtype, device=r.device).scatter(1, slot, v)[:, :n_turns]
    real = torch.arange(n_turns, device=r.device) < count.unsqueeze(-1)
    next_v = torch.cat([turn_v[:, 1:], torch.zeros(b, 1, dtype=dtype, device=r.device)], dim=-1)
    next_real = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=-1)
    next_v = torch.where(next_real, next_v, torch.zeros_like(next_v))
    turn_delta = turn_r + high_level_gamma * next_v - turn_v
    turn_adv = _reverse_gae(
        torch.where(real, turn_delta, torch.zeros_like(turn_delta)), high_level_gamma * lam, real
    )
    target = turn_adv + turn_v  # G_k
    # Token level: the target replaces the reward at each turn's end, which bootstraps nothing.
    at_end = target.gather(1, k.clamp(0, max(n_turns - 1, 0))) if n_turns else torch.zeros_like(r)
    v_after = torch.cat([v[:, 1:], torch.zeros(b, 1, dtype=dtype, device=v.device)], dim=-1)
    delta = torch.where(ends, at_end - v, r + gamma * v_after - v)
    raw = _reverse_gae(delta, gamma * lam, m, restart=ends)
    zero = torch.zeros_like(raw)
    returns = torch.where(m, raw + v, zero)
    advantages = _whiten(raw, m) if whiten else torch.where(m, raw, zero)
    return advantages, returns
