"""Small statistics shared by the trainers' evaluations and reports."""

from __future__ import annotations

import math


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
