"""DAPO's batch pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"): overlong reward shaping, dynamic-sampling group filter, overlong filtering.

Clip-higher and token-level aggregation, DAPO's other two pieces, are `ppo_loss(clip_high=...)`
and `agg="token_mean"` in `mmrl.algos.losses`. The refill loop of dynamic sampling belongs to the
trainer; `informative_groups` decides which groups it keeps.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward.

        R(L) = 0                                  L <= max_len - buffer
             = ((max_len - buffer) - L) / buffer  max_len - buffer < L <= max_len
             = -1                                 L > max_len
        times `factor`.

    The penalty ramps linearly from 0 to -1 over the last `buffer` tokens of the budget.

    Args:
        lengths: [N] response lengths in tokens.
        max_len: L_max, the length budget (DAPO: the generation limit).
        buffer: L_cache, the length of the ramp (0 <= buffer <= max_len; 0: a hard step at
            max_len).
        factor: scale of the penalty (>= 0).

    Returns:
        [N] float penalties in [-factor, 0].
    """
    if not 0 <= buffer <= max_len:
        raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer}")
    if not factor >= 0:
        raise ValueError(f"overlong factor must be >= 0, got {factor}")
    length = lengths.float()
    start = float(max_len - buffer)
    ramp = (start - length) / max(buffer, 1)
    penalty = torch.where(length <= start, torch.zeros_like(length), ramp)
    penalty = torch.where(length > max_len, torch.full_like(length, -1.0), penalty)
    return penalty * factor


def informative_groups(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Dynamic sampling's filter: the groups whose rewards are not all equal.

    A group whose G rewards are equal has zero advantage under every group-baselined estimator
    and contributes no gradient; DAPO drops it and samples more prompts.

    Args:
        rewards: [N] (or [N, K] reward components: a group is informative if any component
            varies, as GDPO's advantages then do), N = B x G, prompt-major.
        group_size: G.
        valid: optional [N] bool; only valid rows are compared (fewer than two: not informative).

    Returns:
        [B] bool, True for groups to keep.
    """
    if rewards.dim() not in (1, 2) or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be [N] or [N, K] with N a multiple of group_size={group_size}, "
            f"got shape {list(rewards.shape)}"
        )
    r = rewards.float().view(-1, group_size, 1 if rewards.dim() == 1 else rewards.shape[1])
    if valid is None:
        v = torch.ones(r.shape[:2], dtype=torch.bool, device=r.device)
    else:
        if valid.shape != rewards.shape[:1]:
            raise ValueError(f"valid must be [N] = [{rewards.shape[0]}], got shape {list(valid.shape)}")
        v = valid.bool().view(-1, group_size)
    vm = v.unsqueeze(-1)
    hi = torch.where(vm, r, torch.full_like(r, -torch.inf)).amax(dim=1)
    lo = torch.where(vm, r, torch.full_like(r, torch.inf)).amin(dim=1)
    varies = (hi > lo).any(dim=-1)
    return varies & (v.sum(dim=1) >= 2)


def truncation_mask(truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: 0 for truncated responses, 1 for the others.

    Args:
        truncated: [N] bool, True where generation hit the length limit without ending.

    Returns:
        [N] float; multiply the loss mask by it (`mask * truncation_mask(t)[:, None]`) so a
        truncated response is masked out of the loss. Its reward still enters the advantage
        statistics of its group.
    """
    if truncated.dim() != 1:
        raise ValueError(f"truncated must be [N], got shape {list(truncated.shape)}")
    return (~truncated.bool()).float()
