"""Policy losses: pure functions over per-token tensors returning (loss, metrics).

Shapes: N rows (responses), R response positions. `mask` is 1 on tokens that count.
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Sum of masked values over `denom` (default: the number of masked-in tokens)."""
    total = (values * mask).sum()
    if denom is None:
        denom = mask.sum().clamp(min=1).item()
    return total / denom


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

        ratio    = exp(logprobs - old_logprobs)                      # [N, R]
        pg_loss1 = -A * ratio
        pg_loss2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)
        loss     = sum(max(pg_loss1, pg_loss2) * mask) / token_denom

    Args:
        logprobs: [N, R] current policy log-probs (with grad).
        old_logprobs: [N, R] log-probs of the policy that sampled the batch.
        advantages: [N] one advantage per response, broadcast over its tokens.
        mask: [N, R] 1 for tokens in the loss.
        token_denom: tokens the loss is averaged over; pass the mini-batch's token count when
            a mini-batch is split into micro-batches so their sum equals the full-batch loss.

    Returns:
        loss, and metrics: clip fractions (ratio clipped below with A<0 / above with A>0),
        ratio mean/min/max.
    """
    A = advantages.unsqueeze(-1)  # [N, 1]
    ratio = torch.exp(logprobs - old_logprobs)
    pg_loss1 = -A * ratio
    pg_loss2 = -A * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_loss1, pg_loss2)
    loss = masked_mean(pg_losses, mask, token_denom)
    with torch.no_grad():
        m = mask.bool()
        r = ratio[m]
        a = A.expand_as(ratio)[m]
        n = max(int(m.sum()), 1)
        metrics = {
            "clip_frac_low": float(((r < 1.0 - clip_low) & (a < 0)).sum()) / n,
            "clip_frac_high": float(((r > 1.0 + clip_high) & (a > 0)).sum()) / n,
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_min": float(r.min()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
        }
    return loss, metrics
