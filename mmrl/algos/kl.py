"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL").

With log-ratio x = log pi(a) - log pi_ref(a) for a ~ pi:
    k1 = x                      unbiased, can be negative
    k2 = x^2 / 2                biased, low variance
    k3 = (e^{-x} - 1) + x       unbiased and always >= 0 (clamped to <= 10 as veRL does)
    abs = |x|                   veRL's `abs`
    k1+, k3+                    the value of k1 / k3 with the gradient of k2 (straight-through:
                                k2 - sg(k2) + sg(k)), veRL's "+" names; k2+ is k2 itself
    full                        the exact KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v))
                                at each position, over the whole vocabulary; it needs both models'
                                distributions, not two log-probs, and is computed from their
                                final hidden states by `mmrl.algos.logprobs.head_full_kl`
                                (chunked: memory bounded by a few [chunk, V] tensors)

The straight-through forms exist because, in the loss, k2's gradient is the one that follows
KL(pi || pi_ref) on-policy (below), while k1 / k3 give the better value to log (k1 unbiased, k3
unbiased and non-negative); veRL pairs the two (its `kl_penalty`, PR #2953).

Where the KL goes (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation
for RL"; Zhang et al. 2025, "On the design of KL-regularized policy gradient algorithms"):

- **In the reward** (`kl_penalized_rewards`; InstructGPT-style PPO, REINFORCE++): subtract
  beta * sum_t kl_t from each response's reward before the advantage estimator. No gradient
  flows through it; use k1, whose sum over a response is the sequence log-ratio, an unbiased
  estimate of the sequence-level KL(pi || pi_ref).
- **In the loss** (`kl_in_loss`; GRPO, DeepSeekMath): add beta * aggregate(kl_t) to the policy
  loss and differentiate through log pi. There the estimator decides the gradient, on-policy:
  k1 has zero expected gradient (useless), k2 gives the gradient of KL(pi || pi_ref), and k3
  (GRPO's choice, non-negative and low-variance) gives the gradient of the forward
  KL(pi_ref || pi); both regularise towards the reference.
"""

from __future__ import annotations

import torch

from mmrl.algos.losses import aggregate

KL_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k2+", "k3+", "abs", "full")
"""Names `algo.kl_estimator` accepts; `full` is computed from distributions, not by `kl_estimate`."""
K3_EXPONENT_CLAMP = 20.0
"""|ref - logp| is clamped to this before the exponential (veRL's `low_var_kl`)."""
K3_VALUE_CLAMP = 10.0
"""The k3 value is clamped to [-10, 10] (veRL's `low_var_kl`): no gradient past it."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from the two log-probs of the sampled token; inputs
    and output [N, R]. `full` is not computed here (it needs the distributions)."""
    log_ratio = logprobs - ref_logprobs
    if estimator.endswith("+") and estimator != "k2+":
        value = kl_estimate(logprobs, ref_logprobs, estimator[:-1])
        k2 = 0.5 * log_ratio.square()
        return k2 - k2.detach() + value.detach()  # the value of k1 / k3, the gradient of k2
    if estimator == "k1":
        return log_ratio
    if estimator in ("k2", "k2+"):
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "full":
        raise ValueError(
            "kl estimator 'full' needs both models' distributions, not two log-probs: use "
            "mmrl.algos.logprobs.head_full_kl (the trainer does with algo.kl_estimator=full)"
        )
    if estimator == "k3":
        # veRL's `low_var_kl`: the exponent is clamped to +-20 (no overflow) and the value to
        # +-10, which also bounds the gradient: a token with ref - logp > ~2.53 (k3 > 10) gets
        # none, where the unclamped value's would be 1 - e^(ref - logp) (-53.6 at 4, ~-5e8 at 20).
        kl = (-log_ratio).clamp(min=-K3_EXPONENT_CLAMP, max=K3_EXPONENT_CLAMP)
        return (torch.expm1(kl) - kl).clamp(min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}: choose from {', '.join(KL_ESTIMATORS)}")


def kl_penalized_rewards(
    rewards: torch.Tensor, kl_per_token: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """The KL in the reward: r_i - beta * sum_t m_t kl_t.

    Args:
        rewards: [N] one scalar reward per response.
        kl_per_token: [N, R] per-token KL estimates (`kl_estimate(logprobs, ref_logprobs, "k1")`);
            detached here, no gradient flows through a reward.
        mask: [N, R] 1 on response tokens; masked-out entries are ignored (even NaN/inf).
        beta: the KL coefficient (>= 0).

    Returns:
        [N] penalised rewards, to feed to an advantage estimator. A fully masked row keeps its
        reward.
    """
    if kl_per_token.dim() != 2 or kl_per_token.shape != mask.shape:
        raise ValueError(
            f"kl_per_token {list(kl_per_token.shape)} and mask {list(mask.shape)} must both be [N, R]"
        )
    if rewards.shape != kl_per_token.shape[:1]:
        raise ValueError(f"rewards must be [N] = [{kl_per_token.shape[0]}], got shape {list(rewards.shape)}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    kl = kl_per_token.detach().float()
    kl_sum = torch.where(mask > 0, kl, torch.zeros_like(kl)).sum(dim=-1)
    return rewards.float() - beta * kl_sum


def kl_in_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
    agg: str = "token_mean",
    denom: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """The KL in the loss: aggregate(kl_estimate(logprobs, ref_logprobs), mask) as a scalar.

    Aggregated exactly like the policy loss (same `agg`, `denom`, `max_len`, see
    `mmrl.algos.losses.aggregate`) so that micro-batch terms sum to the mini-batch's; multiply
    by the coefficient and add it to the policy loss.

    Args:
        logprobs: [N, R] current policy log-probs (with grad).
        ref_logprobs: [N, R] the frozen reference's log-probs.
        mask: [N, R] 1 on tokens in the loss.
    """
    m = mask > 0
    # Masked-out positions may hold garbage (-inf): zero both sides so no NaN reaches the grad.
    lp = torch.where(m, logprobs, torch.zeros_like(logprobs))
    ref = torch.where(m, ref_logprobs.detach(), torch.zeros_like(lp))
    return aggregate(kl_estimate(lp, ref, estimator), mask, agg, denom, max_len)
