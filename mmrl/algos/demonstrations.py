"""Learning from demonstrations inside RL: a supervised term on reference solutions, mixed into
the policy loss (LUFFY, SRFT, TRAPO). Pure functions over [N, R] tensors (N demonstrations, R
token positions; `mask` 1 on demonstration tokens).

| kind | per-token loss | gradient | from |
|---|---|---|---|
| `nll` | -log pi(y_t) | -grad log pi | SFT mixed into RL: Yan et al. 2025 (LUFFY, "Learning to Reason under Off-Policy Guidance"); Fu et al. 2025 (SRFT, "A Single-Stage Method with Supervised and Reinforcement Fine-Tuning") |
| `trust_region` | sg(min(1, pi / alpha)) (-log pi) | -min(1, pi / alpha) grad log pi = -grad pi / max(pi, alpha) | Su et al. 2025, "Trust-Region Adaptive Policy Optimization" (TRAPO's TrSFT) |

TrSFT's point: plain NLL's gradient on a token the policy finds unlikely is large and pulls
probability mass towards regions the policy does not support (forward KL is mode-covering),
which destabilises the RL on the same policy. Inside the trust region (pi >= alpha) TrSFT is
plain NLL; outside, the gradient is damped by pi / alpha, i.e. it becomes the gradient of
pi / alpha itself, which behaves like a reverse-KL (mode-seeking) update. TRAPO's code writes
the loss as -pi / max(sg(pi), alpha) (its `clip_low` reshape, alpha = 0.1); the form here has
the same gradient and keeps the NLL as its value, so the logged loss stays comparable.
"""

from __future__ import annotations

import torch

DEMO_LOSSES = ("nll", "trust_region")


def demonstration_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "nll",
    alpha: float = 0.1,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The supervised term on demonstration tokens, token-mean aggregated.

        nll:           l_t = -log pi_t
        trust_region:  l_t = sg(min(1, pi_t / alpha)) * (-log pi_t)
        loss = sum_t m_t l_t / denom            (denom: default the number of masked tokens)

    Args:
        logprobs: [N, R] the policy's log-probs of the demonstration tokens (with grad).
        mask: [N, R] 1 on demonstration tokens (padding 0; masked entries may hold anything).
        kind: `nll` or `trust_region`.
        alpha: the trust region's probability bound, in (0, 1].
        denom: the mini-batch's demonstration-token count when a mini-batch is split into
            micro-batches (their losses then sum to the mini-batch's); at least 1.

    Returns:
        (loss, metrics): the scalar loss (0, with a zero gradient, when no token is masked) and
        `demo/nll` (mean -log pi over the masked tokens), `demo/token_prob` (mean pi),
        `demo/trust_frac` (share of tokens with pi >= alpha; 1 for `nll`), `demo/tokens`.
    """
    if kind not in DEMO_LOSSES:
        raise ValueError(f"unknown demonstration loss {kind!r}: choose from {list(DEMO_LOSSES)}")
    if not 0 < alpha <= 1:
        raise ValueError(f"demonstration trust-region alpha must be in (0, 1], got {alpha}")
    if logprobs.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"logprobs {list(logprobs.shape)} and mask {list(mask.shape)} must both be [N, R]")
    m = mask > 0
    lp = torch.where(m, logprobs, torch.zeros_like(logprobs))
    nll = -lp
    with torch.no_grad():
        p = lp.detach().exp()
        inside = p >= alpha
    if kind == "trust_region":
        per_token = torch.where(inside, nll, nll * (p / alpha))
    else:
        per_token = nll
    n = int(m.sum())
    loss = torch.where(m, per_token, torch.zeros_like(per_token)).sum() / (
        denom if denom is not None else max(n, 1)
    )
    with torch.no_grad():
        metrics = {
            "demo/nll": float(nll[m].mean()) if n else 0.0,
            "demo/token_prob": float(p[m].mean()) if n else 0.0,
            "demo/trust_frac": (float(inside[m].float().mean()) if n else 1.0)
            if kind == "trust_region"
            else 1.0,
            "demo/tokens": float(n),
        }
    return loss, metrics
