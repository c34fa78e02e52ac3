"""End to end: GRPO raises held-out accuracy on the built-in task, and the gain needs vision.

These are the slow tests (a few minutes on 2 cores); they run in CI too.
"""

from __future__ import annotations

import pytest
from PIL import Image

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.models.loading import load_policy
from mmrl.rollout.hf import HFRolloutEngine
from mmrl.router import Router
from mmrl.train.evaluation import evaluate
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow

# The shortened recipe: the default one with fewer steps at a constant learning rate, evaluated
# at the ends only (an evaluation in between would not change the run: it draws from no
# generator the training uses; measured, the same rewards at every step).
SHORT_RECIPE = [
    "trainer.total_steps=80",
    "trainer.eval_every=80",
    "optim.schedule=constant",
    "trainer.progress=false",
]
# Margin: held-out accuracy is measured on 512 prompts, whose sampling noise is at most
# sqrt(0.25 / 512) = 2.2 points, so a run that learned nothing lands within a few points of its
# start. Across seeds 0-3 (trainer.seed = model.warmup.seed) this recipe gained +41.6, +64.1,
# +37.9 and +48.6 points (measured on the 2-core CI machine). 15 points is ~7 sigma of the
# evaluation noise and less than half of the smallest measured gain.
MIN_GAIN = 0.15


@pytest.fixture(scope="module")
def short_run(mmrl_cache, tmp_path_factory):
    cfg = load_config(
        "vision_reasoning", overrides=[*SHORT_RECIPE, f"trainer.run_dir={tmp_path_factory.mktemp('run')}"]
    )
    return train(cfg)


def test_grpo_raises_heldout_accuracy_by_a_margin_above_noise(short_run):
    gain = short_run.final_accuracy - short_run.start_accuracy
    assert gain >= MIN_GAIN, f"{short_run.start_accuracy:.3f} -> {short_run.final_accuracy:.3f}"


def test_the_trained_model_needs_the_image(short_run):
    """With every image replaced by a blank one the trained model falls to chance (1/6)."""
    policy = load_policy(short_run.run_dir / "final")
    engine = HFRolloutEngine.from_policy(policy)
    heldout = make_samples(["colour_code"], 512, "heldout")
    blank = [
        type(s)(**{**s.__dict__, "images": [Image.new("RGB", (64, 64), (240, 240, 240))]}) for s in heldout
    ]
    with Router(num_workers=0) as router:
        seeing = evaluate(engine, router, heldout, 16)["eval/accuracy"]
        blind = evaluate(engine, router, blank, 16)["eval/accuracy"]
    assert seeing == pytest.approx(short_run.final_accuracy)
    assert blind < 0.30  # chance is 1/6: one answer for every blank image scores ~0.17
    assert seeing - blind >= 0.25
