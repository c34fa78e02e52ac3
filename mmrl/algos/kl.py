"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL").

With log-ratio x = log pi(a) - log pi_ref(a) for a ~ pi:
    k1 = x                      unbiased, can be negative
    k2 = x^2 / 2                biased, low variance
    k3 = (e^{-x} - 1) + x       unbiased and always >= 0
"""

from __future__ import annotations

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate; inputs and output [N, R]."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # Clamp the exponent so a wildly off token cannot overflow to inf.
        return torch.expm1(-log_ratio.clamp(min=-20.0, max=20.0)) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: choose from k1, k2, k3")
