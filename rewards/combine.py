"""Combining several rewards into one signal, keeping every component for logging.

Rows are prompt-major, as everywhere in mmrl: rows i*G .. i*G+G-1 are the G responses (or
images) for prompt i, so `[B x G]` vectors split into groups of `group_size`.

- `weighted_sum`: `r = sum_k w_k r_k`; the trainer then normalises `r` within each group (GRPO).
- `gdpo_advantages`: GDPO's decoupled normalisation (Liu et al., 2026, "GDPO: Group reward-
  Decoupled Normalization Policy Optimization for Multi-reward RL"): each reward is normalised
  within its group first, `A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)`, then
  `A = sum_k w_k A_k`, and optionally `A` is normalised over the whole batch. Summing first lets
  a reward with a large spread drown the others (and distinct reward vectors collapse onto the
  same advantages); normalising each first gives every reward its own say. The result is an
  advantage: the trainer uses it as is, without normalising it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mmrl.algos.advantages import gdpo_advantages as algos_gdpo
from mmrl.algos.advantages import group_advantages

ComponentsLike = Mapping[str, Sequence[float] | torch.Tensor]
"""Named per-row rewards, each `[B x G]`."""


@dataclass
class CombinedRewards:
    """A combined reward (or advantage) with its parts."""

    total: torch.Tensor
    """[B x G] the weighted sum (`weighted_sum`) or the combined advantage (`gdpo_advantages`)."""
    components: dict[str, torch.Tensor]
    """[B x G] each raw reward, by name."""
    weights: dict[str, float]
    """The weight of each reward."""
    normalised: dict[str, torch.Tensor] = field(default_factory=dict)
    """[B x G] each reward normalised within its group (GDPO only)."""

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Batch means for logging: `<prefix><name>` of each raw component, `<prefix>total`."""
        out = {f"{prefix}{name}": float(v.float().mean()) for name, v in self.components.items()}
        out[f"{prefix}total"] = float(self.total.float().mean())
        return out

    def rows(self) -> list[dict[str, float]]:
        """Per-row dicts `{name: raw reward, ..., "total": combined}` (for dumps and the server)."""
        names = list(self.components)
        return [
            {**{n: float(self.components[n][i]) for n in names}, "total": float(self.total[i])}
            for i in range(len(self.total))
        ]


def _stack(components: ComponentsLike, weights: Mapping[str, float] | None) -> tuple[dict, dict]:
    if not components:
        raise ValueError("no reward components to combine")
    tensors = {k: torch.as_tensor(v, dtype=torch.float32).reshape(-1) for k, v in components.items()}
    lengths = {k: t.numel() for k, t in tensors.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"reward components differ in length: {lengths}")
    weights = {k: 1.0 for k in tensors} if weights is None else dict(weights)
    missing = sorted(set(tensors) - set(weights))
    extra = sorted(set(weights) - set(tensors))
    if missing or extra:
        raise ValueError(
            f"weights do not match the components: no weight for {missing}, no component for {extra}"
        )
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"reward component {name!r} has non-finite values")
    return tensors, {k: float(weights[k]) for k in tensors}


def weighted_sum(components: ComponentsLike, weights: Mapping[str, float] | None = None) -> CombinedRewards:
    """`total = sum_k w_k r_k` over `[B x G]` components (weights default to 1)."""
    tensors, weights = _stack(components, weights)
    total = sum(weights[k] * t for k, t in tensors.items())
    return CombinedRewards(total=total, components=tensors, weights=weights)


def gdpo_advantages(
    components: ComponentsLike,
    group_size: int,
    weights: Mapping[str, float] | None = None,
    eps: float = 1e-6,
    batch_normalise: bool = True,
) -> CombinedRewards:
    """GDPO: normalise each reward within its group, weight and sum, then (optionally)
    normalise the sum over the batch: `(A - mean(A)) / (std(A) + eps)`.

    Args:
        components: name -> `[B x G]` rewards.
        group_size: G.
        weights: name -> weight (default 1 each).
        eps: added to each std (an all-equal group gets advantage 0 for that reward).
        batch_normalise: GDPO's final batch-wise normalisation of the summed advantage.

    Returns:
        `total` is the `[B x G]` advantage; `normalised` holds each reward's group-normalised
        values. Stds are unbiased, as in `mmrl.algos.advantages.group_advantages`.
    """
    tensors, weights = _stack(components, weights)
    normalised = {k: group_advantages(t, group_size, eps=eps) for k, t in tensors.items()}
    if batch_normalise:  # the estimator the VLM trainer uses (`algo.advantage=gdpo`)
        stacked = torch.stack(list(tensors.values()), dim=1)  # [N, K]
        total = algos_gdpo(stacked, group_size, eps=eps, weights=[weights[k] for k in tensors])
    else:
        total = sum(weights[k] * a for k, a in normalised.items())
    return CombinedRewards(total=total, components=tensors, weights=weights, normalised=normalised)
