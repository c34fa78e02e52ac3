"""Token log-probabilities and entropy from logits, shared by the rollout engine and the trainer.

Both sides must compute the same distribution for the rollout log-probs to equal the trainer's
recomputed ones: logits with blocked tokens set to -inf, divided by the sampling temperature.
"""

from __future__ import annotations

import torch


def masked_logits(logits: torch.Tensor, blocked: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Logits of the sampling distribution: blocked ids removed, then scaled by 1/temperature.

    Args:
        logits: [..., V] raw model logits.
        blocked: [V] bool, True for ids that may never be sampled (vision/structural tokens,
            padded vocabulary rows); None blocks nothing.
        temperature: > 0.
    """
    logits = logits.float()
    if blocked is not None:
        logits = logits.masked_fill(blocked, float("-inf"))
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under softmax(logits). logits [N, T, V], tokens [N, T] -> [N, T]."""
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - logz


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim; -inf logits contribute 0. [N, T, V] -> [N, T]."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -(p * logp.nan_to_num(neginf=0.0)).sum(-1)
