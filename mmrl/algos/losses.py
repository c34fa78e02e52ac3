"""Policy losses: pure functions over per-token tensors returning (loss, metrics), selected by name.

Shapes: N rows (responses), R response positions. `mask` [N, R] is 1 on tokens that count, 0
on padding (a fully masked row contributes nothing). Every loss in `POLICY_LOSSES` is called
the same way,

    fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_dual=None,
       agg="token_mean", denom=None, weights=None, max_len=None) -> (loss, metrics)

    logprobs      [N, R] current policy log-probs (with grad)
    old_logprobs  [N, R] log-probs of the policy that sampled the batch (no grad)
    advantages    [N]    one advantage per response, broadcast over its tokens; or [N, R],
                         one per token (a critic's GAE, `mmrl.algos.critic`)
    weights       [N, R] optional detached per-token multiplier (truncated importance
                         sampling weights, `mmrl.algos.tis`); None = 1

and returns metrics over the masked tokens: `clip_frac_low`, `clip_frac_high`,
`clip_frac_dual`, `ratio_mean`, `ratio_min`, `ratio_max`.

| name | per-token loss |
|---|---|
| `ppo` | max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual-clipped at -A c for A < 0 |
| `gspo` | the same on the sequence ratio s_i = exp(mean_t log r_t), token form sg(s_i) pi / sg(pi) |
| `cispo` | -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi |
| `clip_cov` | PPO, with a random few high-covariance tokens (cov(log pi, A) in (lb, ub)) given no gradient |
| `kl_cov` | -A r, plus kl_coef abs(log r) on the top-k covariance tokens |
| `cispo_seq` | -sg(min(s_i, 1 + eps_high)) A log pi, s_i the geometric-mean sequence ratio (TRL) |
| `gmpo` | -A exp(mean_t clip_A(log r_t)): the geometric mean of token ratios, clipped per token in log space |
| `sapo` | -A f(r), f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos (A > 0) or tau_neg |
| `gpg` | -A log pi (plain policy gradient, no ratio) |

`clip_cov` takes `cov_ratio`, `cov_lb`, `cov_ub`; `kl_cov` takes `cov_ratio`, `kl_coef`; `sapo`
takes `tau_pos`, `tau_neg`; `cispo_seq` takes `floor` (`loss_options` gives them from `algo`).

Each built-in is written as its per-token loss l [N, R] over a `TokenBatch` (the checked
inputs) and registered with `token_loss`, which gives it the signature above: the input
checks, the per-token weights and the aggregation are one piece of code for every loss.
`register_policy_loss` registers a function that already has the whole signature.

Aggregations (`AGGREGATIONS`, see `aggregate`): `token_mean`, `seq_mean_token_mean`,
`seq_mean_token_sum_norm`. When a mini-batch is split into micro-batches, pass every
micro-batch `denom=loss_denominator(minibatch_mask, agg, max_len)` and their losses sum to the
mini-batch loss.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Log-ratios are clamped to +-this before exp so a wildly off token cannot overflow to inf
# (beyond it the ratio is constant and has no gradient). veRL clamps PPO's, SAPO's and CISPO's
# log-ratio at +-20 as well; its Clip-Cov and KL-Cov do not clamp at all (see those losses).
LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is clamped above only, at 10, as veRL's `compute_policy_loss_gspo`.
GSPO_LOG_RATIO_MAX = 10.0

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
DUAL_CLIP_REFUSALS: dict[str, str] = {}
"""Losses registered with `token_loss(..., no_dual_clip=why)`: why each refuses `clip_dual`."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register `fn`, which takes the whole common signature (see the module docs), as `name`."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}: choose from {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x where the bool mask m is set, 0 elsewhere (NaN or inf there included)."""
    return torch.where(m, x, torch.zeros_like(x))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Sum of masked values over `denom` (default: the number of masked-in tokens)."""
    total = (values * mask).sum()
    if denom is None:
        denom = mask.sum().clamp(min=1).item()
    return total / denom


# ---------------------------------------------------------------------------------------------
# Aggregation


def _check_agg(agg: str, max_len: int | None) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}: choose from {list(AGGREGATIONS)}")
    if max_len is not None and not max_len > 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")


def loss_denominator(mask: torch.Tensor, agg: str = "token_mean", max_len: int | None = None) -> float:
    """The normaliser of `aggregate` for a whole mini-batch, so micro-batch losses sum to its loss.

    Args:
        mask: [N, R] the mask of the whole mini-batch.
        agg: `token_mean` -> the number of masked tokens; `seq_mean_token_mean` -> the number of
            sequences with at least one masked token; `seq_mean_token_sum_norm` -> that number of
            sequences times `max_len`.
        max_len: the constant of `seq_mean_token_sum_norm` (Dr.GRPO: the generation budget,
            e.g. `max_new_tokens`); default R, the padded width of `mask`.

    Returns:
        A float >= 1 for token/sequence counts (an empty mask gives a loss of 0, never 0/0).
    """
    _check_agg(agg, max_len)
    m = mask > 0
    if agg == "token_mean":
        return float(max(int(m.sum()), 1))
    seqs = float(max(int(m.any(dim=-1).sum()), 1))
    if agg == "seq_mean_token_mean":
        return seqs
    return seqs * float(max_len if max_len is not None else mask.shape[-1])


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token_mean",
    denom: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, R] over `mask` [N, R] to a scalar.

        token_mean               sum_{i,t} m x / sum_{i,t} m                    (DAPO)
        seq_mean_token_mean      1/S sum_i (sum_t m x / sum_t m)                (GRPO paper, GSPO)
        seq_mean_token_sum_norm  1/S sum_i (sum_t m x / max_len)                (Dr.GRPO)

    S is the number of sequences with at least one masked token; masked-out entries are ignored
    even when they are NaN or inf. With `denom` (from `loss_denominator` of the whole
    mini-batch) the numerator is divided by it instead of by this batch's own normaliser.
    """
    _check_agg(agg, max_len)
    m = mask > 0
    x = _masked(per_token, m)
    if agg == "seq_mean_token_mean":
        total = (x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).sum()
    else:
        total = x.sum()
    if denom is None:
        denom = loss_denominator(mask, agg, max_len)
    return total / denom


# ---------------------------------------------------------------------------------------------
# The common part of every loss: checked inputs in, aggregated weighted loss out


@dataclass(frozen=True)
class TokenBatch:
    """The checked inputs of one policy-loss call, as every per-token loss starts from them."""

    logprobs: torch.Tensor
    """[N, R] current policy log-probs (with grad)."""
    old_logprobs: torch.Tensor
    """[N, R] log-probs of the policy that sampled the batch."""
    adv: torch.Tensor
    """[N, R] each response's advantage on every one of its tokens (detached, logprobs' dtype)."""
    m: torch.Tensor
    """[N, R] bool: the tokens in the loss."""
    clip_low: float
    """Lower clip range (the ratio's bound is 1 - clip_low)."""
    clip_high: float
    """Upper clip range (the ratio's bound is 1 + clip_high)."""
    clip_dual: float | None
    """Dual-clip constant (> 1), or None; always None for a loss that refuses it."""


TokenLoss = tuple[torch.Tensor, dict[str, float]]
"""What a per-token loss returns: l [N, R] (before weights and aggregation) and its metrics."""


def _check_inputs(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    clip_dual: float | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"{name}: logprobs must be [N, R], got shape {list(logprobs.shape)}")
    for what, t in (("old_logprobs", old_logprobs), ("mask", mask), ("weights", weights)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name}: {what} has shape {list(t.shape)}, logprobs has {list(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1] and advantages.shape != logprobs.shape:
        raise ValueError(
            f"{name}: advantages must be [N] = [{logprobs.shape[0]}] (or per token, [N, R]), got shape "
            f"{list(advantages.shape)}"
        )
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"{name}: clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if clip_dual is not None and not clip_dual > 1:
        raise ValueError(f"{name}: clip_dual must be > 1 (typically 3) or None, got {clip_dual}")


def token_loss(
    name: str, no_dual_clip: str | None = None
) -> Callable[[Callable[..., TokenLoss]], PolicyLossFn]:
    """Decorator: register the per-token loss `fn(b: TokenBatch, **options) -> (l, metrics)` as
    the policy loss `name`, with the common signature of the module docs.

    The registered loss checks its inputs (naming `name`), builds the `TokenBatch`, and returns
    `(aggregate(w l, mask, agg, denom, max_len), metrics)`, w the per-token `weights` (detached;
    None = 1). Keyword arguments beyond the common ones go to `fn` as its options.

    no_dual_clip: why the loss refuses `clip_dual` (the error says so), or None if it takes it.
    """

    def wrap(fn: Callable[..., TokenLoss]) -> PolicyLossFn:
        def loss(
            logprobs: torch.Tensor,
            old_logprobs: torch.Tensor,
            advantages: torch.Tensor,
            mask: torch.Tensor,
            *,
            clip_low: float,
            clip_high: float,
            clip_dual: float | None = None,
            agg: str = "token_mean",
            denom: float | None = None,
            weights: torch.Tensor | None = None,
            max_len: int | None = None,
            **options: float,
        ) -> tuple[torch.Tensor, dict[str, float]]:
            dual = None if no_dual_clip else clip_dual
            _check_inputs(name, logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual)
            if no_dual_clip and clip_dual is not None:
                raise ValueError(f"{name}: dual-clip does not apply ({no_dual_clip})")
            adv = advantages.detach().to(logprobs.dtype)
            adv = adv.unsqueeze(-1).expand_as(logprobs) if adv.dim() == 1 else adv  # [N, R]: a critic's
            b = TokenBatch(logprobs, old_logprobs, adv, mask > 0, clip_low, clip_high, dual)
            per_token, metrics = fn(b, **options)
            if weights is not None:
                per_token = per_token * weights.detach()
            return aggregate(per_token, mask, agg, denom, max_len), metrics

        # What help() and inspect show: the common signature plus the loss's own options.
        common = list(inspect.signature(loss).parameters.values())[:-1]
        own = list(inspect.signature(fn).parameters.values())[1:]
        loss.__signature__ = inspect.Signature(
            [*common, *(p.replace(kind=p.KEYWORD_ONLY) for p in own)],
            return_annotation=inspect.signature(loss).return_annotation,
        )
        loss.__name__, loss.__qualname__, loss.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        if no_dual_clip:
            DUAL_CLIP_REFUSALS[name] = no_dual_clip
        return register_policy_loss(name)(loss)

    return wrap


# ---------------------------------------------------------------------------------------------
# Pieces several losses share


def _log_ratio(b: TokenBatch) -> torch.Tensor:
    """logprobs - old_logprobs on masked tokens, 0 (ratio 1, no gradient) elsewhere."""
    return _masked(b.logprobs - b.old_logprobs.detach(), b.m)


def _clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-`LOG_RATIO_CLAMP` (no overflow; constant beyond)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _row_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, 1] mean of x [N, R] (0 off the mask) over each row's masked tokens (0 for none)."""
    return x.sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1)


def _masked_scalar_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _masked(x, m).sum() / m.sum().clamp(min=1)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float, clip_dual: float | None
) -> torch.Tensor:
    """PPO's pessimistic clipped objective per entry (a loss), with the optional dual-clip."""
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    if clip_dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_dual), loss)
    return loss


def _ratio_metrics(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    m: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_dual: float | None,
    signed: bool = True,
) -> dict[str, float]:
    """Clip fractions and ratio stats over the masked tokens (ratio, adv: [N, R]; m bool [N, R]).

    signed: a token counts as clipped low only with A < 0 and high only with A > 0 (where PPO's
    clip removes its gradient); unsigned (CISPO) counts any clipped importance weight.
    """
    with torch.no_grad():
        r, a = ratio[m].float(), adv[m].float()
        n = max(r.numel(), 1)
        low, high = r < 1.0 - clip_low, r > 1.0 + clip_high
        if signed:
            low, high = low & (a < 0), high & (a > 0)
        dual = (r > clip_dual) & (a < 0) if clip_dual is not None else torch.zeros_like(low)
        empty = r.numel() == 0
        return {
            "clip_frac_low": float(low.sum()) / n,
            "clip_frac_high": float(high.sum()) / n,
            "clip_frac_dual": float(dual.sum()) / n,
            "ratio_mean": 1.0 if empty else float(r.mean()),
            "ratio_min": 1.0 if empty else float(r.min()),
            "ratio_max": 1.0 if empty else float(r.max()),
        }


def _ppo_metrics(ratio: torch.Tensor, b: TokenBatch) -> dict[str, float]:
    """`_ratio_metrics` with the call's own clip ranges: what PPO clips (or would have)."""
    return _ratio_metrics(ratio, b.adv, b.m, b.clip_low, b.clip_high, b.clip_dual)


# ---------------------------------------------------------------------------------------------
# Losses


@token_loss("ppo")
def ppo_loss(b: TokenBatch) -> TokenLoss:
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO, Yu et al. 2025) and dual-clip
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").

        r_t   = exp(logprobs - old_logprobs)                                  # [N, R]
        l_t   = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
        l_t   = min(l_t, -A clip_dual)          if A < 0 and clip_dual is set (clip_dual > 1)
        loss  = aggregate(w_t l_t, mask, agg, denom, max_len)

    Clip-higher: a larger clip_high lets low-probability tokens with A > 0 grow (against entropy
    collapse). Dual-clip: for A < 0 an unbounded ratio would give an unbounded loss; it is
    capped at -A c (a constant, so no gradient there).

    Metrics: `clip_frac_low` (r < 1 - clip_low with A < 0), `clip_frac_high` (r > 1 + clip_high
    with A > 0), `clip_frac_dual` (r > clip_dual with A < 0), token `ratio_mean/min/max`.
    """
    ratio = _clamped_exp(_log_ratio(b))
    return _clipped_surrogate(ratio, b.adv, b.clip_low, b.clip_high, b.clip_dual), _ppo_metrics(ratio, b)


@token_loss("gspo")
def gspo_loss(b: TokenBatch) -> TokenLoss:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO-clip on the sequence ratio.

        log s_i  = (1 / |y_i|) sum_t m_t (logprobs - old_logprobs)       # length-normalised
        s_i,t    = sg(s_i) * pi(y_t) / sg(pi(y_t))                        # value s_i, grad of token t
        l_i,t    = max(-A_i s_i,t, -A_i clip(s_i,t, 1 - clip_low, 1 + clip_high))   (+ dual-clip)
        loss     = aggregate(w_t l_i,t, mask, agg, denom, max_len)

    Every token of response i carries the same ratio s_i (so the whole response is clipped or
    not), and its gradient is A_i s_i grad log pi(y_t). The paper's objective is the
    `seq_mean_token_mean` aggregation; its clip ranges are tiny (clip_low 3e-4, clip_high 4e-4)
    because s_i is a per-token geometric mean. log s_i,t is clamped above at 10 and not below,
    as in veRL (a response whose mean log-ratio exceeds 10 gets no gradient; below, s_i only
    goes to 0).

    Metrics are the PPO ones with each token's ratio being its sequence's s_i (token-weighted).
    """
    seq_log_ratio = _row_mean(_log_ratio(b), b.m)
    lp = _masked(b.logprobs, b.m)
    ratio = torch.exp((lp - lp.detach() + seq_log_ratio.detach()).clamp(max=GSPO_LOG_RATIO_MAX))
    return _clipped_surrogate(ratio, b.adv, b.clip_low, b.clip_high, b.clip_dual), _ppo_metrics(ratio, b)


@token_loss("cispo", no_dual_clip="the importance weight is already clipped")
def cispo_loss(b: TokenBatch) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update.

        r_t  = exp(logprobs - old_logprobs)
        l_t  = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * logprobs
        loss = aggregate(w_t l_t, mask, agg, denom, max_len)

    The clipped weight is detached, so every token keeps the gradient -clip(r_t) A grad log pi:
    unlike PPO, tokens beyond the clip bound still learn (the paper's point: rare "fork" tokens
    with large ratios are not dropped). The paper bounds only from above (clip_low >= 1 means
    no lower bound). The loss value is A-weighted log-probs, not a surrogate near -A.
    Dual-clip does not apply (the weight is already bounded).

    Metrics: `clip_frac_low` / `clip_frac_high` count tokens whose weight was clipped, whatever
    the sign of A; `clip_frac_dual` is 0; token `ratio_mean/min/max`.
    """
    ratio = _clamped_exp(_log_ratio(b).detach())
    is_weight = ratio.clamp(max(1.0 - b.clip_low, 0.0), 1.0 + b.clip_high)
    per_token = -is_weight * b.adv * _masked(b.logprobs, b.m)
    return per_token, _ratio_metrics(ratio, b.adv, b.m, b.clip_low, b.clip_high, None, signed=False)


@token_loss("clip_cov", no_dual_clip="veRL's Clip-Cov has none")
def clip_cov_loss(
    b: TokenBatch, cov_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0
) -> TokenLoss:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"), as veRL's `compute_policy_loss_clip_cov` defines it:

        l_t    = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))       (PPO, no dual-clip)
        cov_t  = (A_t - mean(A)) (log pi_t - mean(log pi))     means over the masked tokens
        C      = tokens not already clipped by PPO with cov_lb < cov_t < cov_ub
        k      = max(floor(cov_ratio * #masked tokens), 1)
        S      = k tokens drawn uniformly at random from C (all of C if it has <= k)
        loss   = aggregate(w_t l_t 1[t not in S], mask, agg, denom, max_len)

    The selected tokens, those whose log-prob moves most with the advantage (the covariance
    that drives entropy down), get no gradient. The random draw uses torch's global generator.
    Statistics are over this call's tokens (veRL: the micro-batch).

    Deviation from veRL: log r_t is clamped to +-20 before exp (`LOG_RATIO_CLAMP`, as in
    `ppo`); veRL's Clip-Cov does not clamp. The two agree wherever |log r_t| <= 20; beyond, a
    token's ratio here is the constant e^+-20 and it gets no gradient (veRL's would be -A r_t,
    and overflows to inf / NaN past log r_t ~ 88 in float32).

    Metrics: the PPO ones, plus `cov_frac` (tokens in S / masked tokens); `clip_frac_dual` 0.
    """
    if not cov_ratio > 0:
        raise ValueError(f"clip_cov: cov_ratio must be > 0, got {cov_ratio}")
    m, adv = b.m, b.adv
    ratio = _clamped_exp(_log_ratio(b))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - b.clip_low, 1.0 + b.clip_high)
    with torch.no_grad():
        lp = _masked(b.logprobs.detach(), m)
        cov = (adv - _masked_scalar_mean(adv, m)) * (lp - _masked_scalar_mean(lp, m))
        clipped_by_ppo = (loss2 > loss1) & m
        candidates = m & ~clipped_by_ppo & (cov > cov_lb) & (cov < cov_ub)
        idx = candidates.nonzero()
        k = max(int(cov_ratio * int(m.sum())), 1)
        if len(idx):  # a permutation whenever there are candidates, as veRL draws one
            idx = idx[torch.randperm(len(idx))[:k].to(idx.device)]
        keep = torch.ones_like(ratio)
        keep[idx[:, 0], idx[:, 1]] = 0.0
    metrics = _ppo_metrics(ratio, b)
    metrics["cov_frac"] = float(len(idx)) / max(int(m.sum()), 1)
    return torch.maximum(loss1, loss2) * keep, metrics


@token_loss("kl_cov", no_dual_clip="veRL's KL-Cov does not clip")
def kl_cov_loss(b: TokenBatch, cov_ratio: float = 2e-4, kl_coef: float = 1.0) -> TokenLoss:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"), as veRL's `compute_policy_loss_kl_cov` defines it:

        l_t    = -A r_t                                     (no clipping at all)
        cov_t  = (A_t - mean(A)) (log pi_t - mean(log pi))  means over the masked tokens
        S      = the k = max(floor(cov_ratio * #masked tokens), 1) tokens of largest cov_t
        l_t   += kl_coef |log pi_t - log pi_old,t|          for t in S
        loss   = aggregate(w_t l_t, mask, agg, denom, max_len)

    The high-covariance tokens are held near the old policy by a KL-like penalty instead of being
    clipped. clip_low / clip_high do not enter the loss; the clip fractions report what PPO would
    have clipped. Ties in cov keep the earlier token.

    Deviation from veRL: log r_t is clamped to +-20 before exp (`LOG_RATIO_CLAMP`); veRL's
    KL-Cov does not clamp. They agree wherever |log r_t| <= 20; beyond, the ratio term of a
    token here is constant and sends no gradient (veRL's sends -A r_t), while the |log r_t|
    penalty of a selected token is never clamped.

    Metrics: the PPO ones, `cov_frac` (tokens in S / masked tokens), `ppo_kl_abs` (mean
    |log r| over the masked tokens).
    """
    if not cov_ratio > 0:
        raise ValueError(f"kl_cov: cov_ratio must be > 0, got {cov_ratio}")
    m, adv = b.m, b.adv
    log_ratio = _log_ratio(b)
    ratio = _clamped_exp(log_ratio)
    per_token = -adv * ratio
    n = int(m.sum())
    selected = torch.zeros_like(m)
    if n:
        with torch.no_grad():
            lp = _masked(b.logprobs.detach(), m)
            cov = (adv - _masked_scalar_mean(adv, m)) * (lp - _masked_scalar_mean(lp, m))
            flat = torch.where(m, cov, torch.full_like(cov, -torch.inf)).flatten()
            k = max(1, int(n * cov_ratio))
            top = torch.sort(flat, descending=True, stable=True).indices[:k]
            selected.view(-1)[top] = True
        per_token = torch.where(selected, per_token + kl_coef * log_ratio.abs(), per_token)
    metrics = _ppo_metrics(ratio, b)
    metrics["cov_frac"] = float(selected.sum()) / max(n, 1)
    metrics["ppo_kl_abs"] = float(_masked_scalar_mean(log_ratio.detach().abs(), m))
    return per_token, metrics


@token_loss("cispo_seq", no_dual_clip="the importance weight is already clipped")
def cispo_seq_loss(b: TokenBatch, floor: bool = False) -> TokenLoss:
    """Sequence-level CISPO: CISPO's clipped, stop-gradient importance weight (MiniMax-M1, 2025)
    taken at the sequence level, with GSPO's length-normalised sequence ratio (Zheng et al.
    2025), as TRL computes `loss_type="cispo"` with `importance_sampling_level="sequence"`:

        log s_i = (1 / |y_i|) sum_t m_t (logprobs - old_logprobs)
        l_i,t   = -sg(min(s_i, 1 + clip_high)) * A_i * logprobs_t
        loss    = aggregate(w_t l_i,t, mask, agg, denom, max_len)

    Every token of a response shares one weight (no token of it is dropped, as in CISPO), so a
    single off-policy token cannot blow up its own gradient; the weight moves with the whole
    response's drift. As in TRL the weight has no lower bound: a response the policy has left
    (s_i near 0) sends almost no gradient. TRL bounds the weight above by epsilon_high itself
    (ScaleRL's eps_max, e.g. 5); its epsilon_high is this 1 + clip_high.

    `floor=True` (`algo.cispo_seq_floor`) also bounds the weight below at 1 - clip_low, as
    token-level `cispo` (and veRL's CISPO) does; that was mmrl's earlier choice and differs from
    TRL: with log-ratios [-20, 0, 0, 0] (s = e^-5) and A = 1, TRL's weight is 0.0067 and the
    floored one 0.8 (clip_low 0.2), 119 times the gradient. log s_i is clamped to +-20 before exp.

    Metrics: `clip_frac_low` / `clip_frac_high` count tokens whose sequence weight was clipped,
    whatever the sign of A (`clip_frac_low` is 0 without `floor`); the ratio stats are of s_i
    (token-weighted).
    """
    with torch.no_grad():
        seq = _row_mean(_log_ratio(b), b.m)
        ratio = _clamped_exp(seq).expand_as(b.logprobs)
        low = max(1.0 - b.clip_low, 0.0) if floor else None
        is_weight = ratio.clamp(low, 1.0 + b.clip_high)
    per_token = -is_weight * b.adv * _masked(b.logprobs, b.m)
    clip_low = b.clip_low if floor else math.inf
    return per_token, _ratio_metrics(ratio, b.adv, b.m, clip_low, b.clip_high, None, signed=False)


@token_loss("gmpo", no_dual_clip="the sequence ratio is clipped per token")
def gmpo_loss(b: TokenBatch) -> TokenLoss:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the
    geometric mean of the token ratios instead of their arithmetic mean, clipped per token in
    log space, as veRL's `compute_policy_loss_geo_mean` defines it:

        x_t     = logprobs - old_logprobs
        x'_t    = sgn(A) min(sgn(A) x_t, sgn(A) clip(x_t, -clip_low, clip_high))
        rho_i   = exp((1 / |y_i|) sum_t m_t x'_t)                      (the clipped geometric mean)
        l_i     = -A_i rho_i,   carried by every token of response i
        loss    = aggregate(w_t l_i, mask, agg, denom, max_len)

    For A > 0 a token's log-ratio counts at most clip_high (beyond it, no gradient); for A < 0 at
    least -clip_low. The gradient of a kept token is -A_i rho_i / |y_i| grad log pi: an outlier
    ratio moves rho_i by its |y_i|-th root only (the paper's stability argument, which allows
    its wider range: clip_low = clip_high = 0.4, i.e. ratios in (e^-0.4, e^0.4)).

    The paper's objective is the mean over responses: `seq_mean_token_mean` (veRL averages over
    all rows, fully masked ones included, which differs only when whole rows are masked).
    Per-token weights multiply the per-token loss as in every other loss (veRL instead
    multiplies l_i by the geometric mean of the weights). The mean log-ratio is clamped to +-20.

    Metrics: `clip_frac_high` (x_t > clip_high with A > 0), `clip_frac_low` (x_t < -clip_low with
    A < 0), ratio stats of rho_i (token-weighted), `clip_frac_dual` 0.
    """
    m, adv = b.m, b.adv
    x = _log_ratio(b)
    sign = torch.sign(adv)
    clipped = sign * torch.minimum(sign * x, sign * x.clamp(-b.clip_low, b.clip_high))
    rho = _clamped_exp(_row_mean(clipped * m, m))  # [N, 1]
    with torch.no_grad():
        n = max(int(m.sum()), 1)
        metrics = _ratio_metrics(rho.detach().expand_as(b.logprobs), adv, m, math.inf, math.inf, None)
        metrics["clip_frac_high"] = float(((x > b.clip_high) & (adv > 0) & m).sum()) / n
        metrics["clip_frac_low"] = float(((x < -b.clip_low) & (adv < 0) & m).sum()) / n
    return (-adv * rho).expand_as(b.logprobs), metrics


@token_loss("sapo", no_dual_clip="the gate is already bounded by 4 / tau")
def sapo_loss(b: TokenBatch, tau_pos: float = 1.0, tau_neg: float = 1.05) -> TokenLoss:
    """SAPO (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a
    smooth, temperature-controlled gate on the token ratio in place of the hard clip, as veRL's
    `compute_policy_loss_sapo` and TRL's `loss_type="sapo"` define it:

        r_t   = exp(logprobs - old_logprobs)
        f(r)  = (4 / tau) sigmoid(tau (r - 1)),     tau = tau_pos if A > 0 else tau_neg
        l_t   = -A f(r_t)
        loss  = aggregate(w_t l_t, mask, agg, denom, max_len)

    d f / d log pi = 4 r sigmoid(u) (1 - sigmoid(u)), u = tau (r - 1): exactly 1 at r = 1 (the
    on-policy gradient is PPO's), decaying smoothly as r leaves 1 instead of dropping to 0 at a
    bound. tau_neg > tau_pos attenuates negative-advantage tokens faster (the paper's 1.05 vs
    1.0: they are the less stable ones). The papers aggregate `seq_mean_token_mean`. clip_low /
    clip_high do not enter the loss; the clip fractions report what PPO would have clipped.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    ratio = _clamped_exp(_log_ratio(b))
    tau = torch.where(b.adv > 0, torch.full_like(b.adv, tau_pos), torch.full_like(b.adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -b.adv * gate, _ppo_metrics(ratio, b)


@token_loss("gpg", no_dual_clip="the loss has no ratio")
def gpg_loss(b: TokenBatch) -> TokenLoss:
    """GPG's loss (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning", arXiv 2504.02546): the plain policy gradient, no surrogate, no ratio, as
    veRL's `compute_policy_loss_gpg`:

        l_t  = -A logprobs_t
        loss = aggregate(w_t l_t, mask, agg, denom, max_len)

    On-policy its gradient equals PPO's at ratio 1; off-policy (later mini-batches, stale
    rollouts) nothing corrects or bounds it (pair it with `algo.tis` if that matters). Pair it
    with the `gpg` advantage estimator. clip_low / clip_high do not enter the loss; the
    metrics report the ratio and what PPO would have clipped.
    """
    with torch.no_grad():
        ratio = _clamped_exp(_log_ratio(b))
    return -b.adv * _masked(b.logprobs, b.m), _ppo_metrics(ratio, b)


NO_DUAL_CLIP = frozenset(DUAL_CLIP_REFUSALS)
"""Losses that refuse `clip_dual` (it needs PPO's clipped ratio)."""


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with separate bounds (clip-higher, DAPO), token-mean aggregated.

    `ppo_loss(..., agg="token_mean", denom=token_denom)`; kept for callers of the first API.

    Args:
        logprobs: [N, R] current policy log-probs (with grad).
        old_logprobs: [N, R] log-probs of the policy that sampled the batch.
        advantages: [N] one advantage per response, broadcast over its tokens.
        mask: [N, R] 1 for tokens in the loss.
        token_denom: tokens the loss is averaged over; pass the mini-batch's token count when
            a mini-batch is split into micro-batches so their sum equals the full-batch loss.
    """
    return ppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        agg="token_mean",
        denom=token_denom,
    )


def loss_options(algo) -> dict[str, float]:
    """The extra keyword arguments `algo.policy_loss` takes, from `AlgoConfig` fields."""
    if algo.policy_loss == "clip_cov":
        return {"cov_ratio": algo.cov_ratio, "cov_lb": algo.clip_cov_lb, "cov_ub": algo.clip_cov_ub}
    if algo.policy_loss == "kl_cov":
        return {"cov_ratio": algo.cov_ratio, "kl_coef": algo.kl_cov_coef}
    if algo.policy_loss == "sapo":
        return {"tau_pos": algo.sapo_tau_pos, "tau_neg": algo.sapo_tau_neg}
    if algo.policy_loss == "cispo_seq" and algo.cispo_seq_floor:
        return {"floor": True}
    return {}
