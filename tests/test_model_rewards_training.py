"""Model-based rewards inside VLM training: named per sample, configured per run, added to
the verifier's reward, logged per component, placed beside the policy."""

from __future__ import annotations

import json

import pytest

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import write_jsonl
from mmrl.rewards.base import RewardModel, RewardOutput, register_reward_model
from mmrl.train.grpo import train

pytestmark = pytest.mark.slow


@register_reward_model("test_brevity")
class Brevity(RewardModel):
    """1 / (1 + characters): rewards short answers (a text-only reward model for the test)."""

    requires = ("responses",)
    cpu_only = True

    def __init__(self, device="cpu"):
        super().__init__("cpu")

    def score_with_components(self, images=None, prompts=None, responses=None, **fields):
        self.check_inputs(images, prompts, responses, fields)
        return RewardOutput(
            scores=[1 / (1 + len(r)) for r in responses],
            components={"chars": [float(len(r)) for r in responses]},
        )


def _data(tmp_path, models):
    samples = make_samples(["colour_code"], 8, "train")
    for s in samples:
        s.reward_model.models = models
    write_jsonl(samples, tmp_path / "train.jsonl")
    write_jsonl(samples[:4], tmp_path / "heldout.jsonl")


def _config(tmp_path, *extra):
    return load_config(
        "vision_reasoning",
        overrides=[
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]",
            "trainer.total_steps=1",
            "trainer.prompts_per_step=4",
            "rollout.group_size=2",
            "trainer.progress=false",
            f"trainer.run_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_model_rewards_are_added_to_the_verifier_reward_and_logged(mmrl_cache, tmp_path):
    _data(tmp_path, [{"name": "brevity", "weight": 2.0}])
    cfg = _config(tmp_path, "reward.model_rewards.models=[{name: brevity, type: test_brevity}]")
    result = train(cfg)
    step = next(
        json.loads(line)
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        if "reward/mean" in json.loads(line)
    )
    chars = step["reward/model/brevity/chars"]
    assert step["reward/model/brevity"] > 0 and step["reward/model/total"] == pytest.approx(
        2 * step["reward/model/brevity"]
    )
    # The reward is the verifier's accuracy plus the weighted model reward.
    assert step["reward/mean"] == pytest.approx(
        step["reward/accuracy"] + step["reward/model/total"], abs=1e-5
    )
    assert chars > 0
    assert step["reward_models/resident/brevity"] == 1.0


def test_a_sample_naming_an_unconfigured_reward_model_fails_before_training(mmrl_cache, tmp_path):
    _data(tmp_path, [{"name": "aesthetic"}])
    with pytest.raises(
        ValueError, match=r"field 'reward_model.models': reward model 'aesthetic' is not configured"
    ):
        train(_config(tmp_path))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
