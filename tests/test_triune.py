"""V-Triune-style joint training: every sample scored by its own verifier, metrics per source."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmrl.config import load_config
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow

SOURCES = [
    "vision_reasoning/colour_code",
    "perception/detection",
    "perception/grounding",
    "perception/counting",
    "perception/ocr",
]


def test_vision_triune_runs_and_reports_every_data_source(mmrl_cache, tmp_path):
    cfg = load_config(
        "vision_triune",
        overrides=[
            "model.warmup.max_steps=25",  # a barely trained base: this test is about the plumbing
            "model.warmup.eval_size=16",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=10",
            "rollout.group_size=2",
            "trainer.eval_every=1",
            "trainer.eval_size=10",
            "trainer.progress=false",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    step = {k: v for r in steps for k, v in r.items()}  # every key either step reported
    evals = [r for r in records if "eval/accuracy" in r]
    for source in SOURCES:
        assert f"reward/mean/{source}" in step
        assert f"reward/accuracy/{source}" in step
        assert f"response/length_mean/{source}" in step
        assert f"reflection/ratio/{source}" in step
        assert all(f"eval/accuracy/{source}" in r for r in evals)
    # Each verifier's own components, under its own source.
    assert "reward/precision@0.5/perception/detection" in step
    assert "reward/map50/perception/grounding" in step
    assert "reward/edit_similarity/perception/ocr" in step
    # The same metrics in TensorBoard ...
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    assert {f"reward/mean/{s}" for s in SOURCES} <= set(events.Tags()["scalars"])
    # ... and a panel per source in the training curves (two rows of panels instead of one).
    png = Image.open(result.run_dir / "training_curves.png")
    assert png.height >= 2 * 300
