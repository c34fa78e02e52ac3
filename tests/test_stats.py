"""The Wilson score interval of the evaluations' accuracies, against hand-worked values."""

from __future__ import annotations

import math

import pytest

from mmrl.stats import mean_interval, wilson_interval


def test_wilson_interval_by_hand():
    z2 = 1.959964**2
    # 0 of 10: (0, z^2 / (n + z^2)), not the normal approximation's empty (0, 0)
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    # 5 of 10: centre 0.5, half-width z sqrt(0.025 + z^2 / 400) / (1 + z^2 / 10)
    half = 1.959964 * math.sqrt(0.025 + z2 / 400) / (1 + z2 / 10)
    assert wilson_interval(5, 10) == pytest.approx((0.5 - half, 0.5 + half))
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(1 - z2 / (10 + z2))
    # 600 images at 50%: under +/-4 points (the evaluations' size), 400 are not
    assert (lambda lo, hi: (hi - lo) / 2)(*wilson_interval(300, 600)) < 0.04
    assert (lambda lo, hi: (hi - lo) / 2)(*wilson_interval(200, 400)) > 0.04
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError, match="11 successes out of 10"):
        wilson_interval(11, 10)


def test_mean_interval_is_wilsons_for_verdicts_and_the_normal_one_for_graded_scores():
    assert mean_interval([1, 0, 1, 1, 0]) == wilson_interval(3, 5)
    assert mean_interval([1.0, 0.0]) == wilson_interval(1, 2)
    # graded scores 0.2, 0.4, 0.6: mean 0.4, sample sd 0.2, half-width 1.96 * 0.2 / sqrt(3)
    half = 1.959964 * 0.2 / math.sqrt(3)
    assert mean_interval([0.2, 0.4, 0.6]) == pytest.approx((0.4 - half, 0.4 + half))
    assert mean_interval([0.9, 1.0, 0.95])[1] == 1.0  # clipped to the score's range
    assert all(math.isnan(v) for v in mean_interval([]))


def test_the_vlm_trainers_last_line_carries_both_intervals_and_the_size():
    from pathlib import Path

    from mmrl.train.grpo import TrainResult

    result = TrainResult(Path("runs/x"), 0.418, 0.844, 0.85, 60, 153.4, start_interval=(0.375, 0.462),
                         final_interval=(0.810, 0.873), eval_size=512)  # fmt: skip
    assert result.summary_line() == (
        "done in 153s: greedy held-out accuracy 0.418 [0.375-0.462] -> 0.844 [0.810-0.873] (+42.6 points; "
        "512 prompts each, 95% intervals); run directory runs/x"
    )
