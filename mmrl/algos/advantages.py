"""Advantage estimators: pure functions over per-response rewards, selected by name.

Rows are prompt-major: rows i*G .. i*G+G-1 are the G responses to prompt i.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def get_advantage_estimator(name: str) -> AdvantageFn:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}: choose from {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


@register_advantage("grpo")
def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps).

    Args:
        rewards: [B x G] one scalar reward per response.
        group_size: G.
        eps: keeps all-equal groups finite (their advantages are exactly 0).
        valid: [B x G] bool; responses marked False are left out of their group's mean and
            std and get advantage 0 (a dropped verifier error).

    Returns:
        [B x G] advantages. The std is the unbiased sample std, as in TRL and veRL; a group with
        fewer than two valid responses has no baseline and gets advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mask = torch.ones_like(grouped) if valid is None else valid.float().view(-1, group_size)
    n = mask.sum(dim=1, keepdim=True)
    mean = (grouped * mask).sum(dim=1, keepdim=True) / n.clamp(min=1)
    var = (((grouped - mean) * mask) ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    adv = (grouped - mean) / (var.sqrt() + eps) * mask
    adv = torch.where(n >= 2, adv, torch.zeros_like(adv))
    return adv.view(-1)
