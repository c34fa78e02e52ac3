"""Training goes on through verifier failures: counted, logged, handled by the stated policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import write_jsonl
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_a_verifier_hanging_in_c_code_is_killed_counted_and_training_continues(
    policy, mmrl_cache, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))  # workers inherit sys.path
    samples = make_samples(["colour_code"], 8, "train")
    for i, s in enumerate(samples):
        s.reward_model.verifier = "hang_on_marked"
        s.extra_info["hang"] = i == 0
    write_jsonl(samples, tmp_path / "train.jsonl")
    write_jsonl(samples[1:5], tmp_path / "heldout.jsonl")
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]",
            "reward.plugins=[hang_verifier]",
            "reward.time_limit_s=0.5",
            f"reward.on_error={policy}",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "rollout.group_size=2",
            "trainer.eval_every=2",
            "trainer.progress=false",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "verifier/timeouts" in r]
    assert len(steps) == 2  # both steps ran
    # The first step's 4 prompts are a random draw of 8; over both steps sample 0 was drawn
    # at most... at least once in 8 draws of 8 without replacement: every sample appears.
    hung = sum(r["verifier/timeouts"] for r in steps)
    assert hung == 2  # sample 0 drawn once (8 draws = one epoch), both of its 2 responses killed
    assert sum(r.get("verifier/timeouts/hang_on_marked/vision_reasoning/colour_code", 0) for r in steps) == 2
    if policy == "drop":
        assert sum(r["verifier/dropped"] for r in steps) == 2
    for r in steps:
        assert all(v is None or v == v for v in r.values())  # no NaN anywhere
