"""The detection reward rises under GRPO on the procedural detection kind (fixed seed).

What a ~0.5M-parameter model learns here in minutes on a CPU is mostly the answer's form and
the colour label; tighter boxes come slowly (see the README). The test therefore reads the
detection verifier's reward during training, not the greedy held-out score.
"""

from __future__ import annotations

import json
import statistics

import pytest

from mmrl.config import load_config
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow

# Margin: the per-step mean reward of 16 x 8 responses varies with a std of 0.02-0.03 between
# neighbouring steps, so a 10-step window mean has a std of about 0.01 and the difference of two
# windows about 0.014. Measured with this recipe (seeds 0 and 1): steps 31-40 minus steps 1-10
# = +0.056 and +0.101. 0.03 is about 2 standard deviations of the noise and about half the
# smaller measured gain.
MIN_GAIN = 0.03


def test_the_detection_reward_rises(mmrl_cache, tmp_path):
    cfg = load_config(
        "perception",
        overrides=[
            "data.kinds=[detection]",
            # The base: the recipe's warm-up stops after 375 steps on this kind (validating every 25).
            # Validating once, at its end, gives the same weights bit for bit (measured December 5,
            # 2026; greedy validations draw from no generator the warm-up uses): 14 validations (0.73
            # CPU-seconds each) fewer.
            "model.warmup.max_steps=375",
            "model.warmup.eval_every=375",
            "model.warmup.patience=1",
            "trainer.total_steps=40",
            "trainer.eval_every=40",
            # the evaluations at the two ends are not asserted on (greedy: they draw from no
            # generator training uses, so their size changes nothing in the run)
            "trainer.eval_size=16",
            "optim.schedule=constant",
            "trainer.progress=false",
            "trainer.save_final=false",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(rewards) == 40
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[30:])
    assert last - first >= MIN_GAIN, f"detection reward {first:.3f} -> {last:.3f}"
    # It is the detection verifier's reward: its components are there, per source too.
    step = next(r for r in records if "reward/mean" in r)
    assert "reward/iou_max_label_first/perception/detection" in step and "reward/map50" in step
