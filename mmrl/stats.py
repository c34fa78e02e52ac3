"""Small statistics shared by the trainers' evaluations and reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default): (low, high) bounds on the
    success rate of `successes` in `n` trials; (nan, nan) when n is 0. Unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes."""
    if n <= 0:
        return float("nan"), float("nan")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes out of {n} trials")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exactly 0 and 1 at the ends,
    high = 1.0 if successes == n else min(1.0, centre + half)  # not a rounding away from them
    return low, high


def mean_interval(values: Sequence[float], z: float = 1.959964) -> tuple[float, float]:
    """A 95% interval of the mean of per-sample scores in [0, 1]: Wilson's when every score is 0
    or 1 (a proportion), else the normal approximation with the sample's standard deviation,
    clipped to [0, 1]; (nan, nan) for no samples."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    if all(v in (0, 1) for v in values):
        return wilson_interval(int(sum(values)), n, z)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half)
