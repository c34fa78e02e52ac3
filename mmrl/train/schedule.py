"""The learning-rate schedule both trainers use (GRPO's `lr_lambda`, flow-GRPO's `learning_rate`)."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def schedule_factor(schedule: str, step: int, total: int, warmup_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total`: a
    linear warm-up over `warmup_steps`, then `constant`, or `linear` / `cosine` decay that
    reaches 0 at step `total`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0
