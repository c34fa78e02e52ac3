"""Combining rewards (weighted sum, GDPO), the reward configs, and the router bridge."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from PIL import Image

import mmrl.rewards.config as config_module
from mmrl.rewards import RewardModel, RewardModelError
from mmrl.rewards.catalog import build_reward_models
from mmrl.rewards.combine import gdpo_advantages, weighted_sum
from mmrl.rewards.config import ModelRewardsConfig, RewardModelConfig, check_kwargs
from mmrl.rewards.jpeg import JpegCompressibility
from mmrl.rewards.router_bridge import check_model_entries, prompt_text, score_model_rewards
from mmrl.types import RewardSpec, Sample

# --- combination ---------------------------------------------------------------------------


def test_weighted_sum_by_hand():
    out = weighted_sum({"a": [1.0, 2.0], "b": [3.0, 5.0]}, {"a": 0.5, "b": 2.0})
    assert out.total.tolist() == [6.5, 11.0]
    assert out.rows() == [{"a": 1.0, "b": 3.0, "total": 6.5}, {"a": 2.0, "b": 5.0, "total": 11.0}]
    assert out.metrics() == {"reward/a": 1.5, "reward/b": 4.0, "reward/total": 8.75}
    assert weighted_sum({"a": [1.0, 2.0]}).total.tolist() == [1.0, 2.0]  # weight 1 by default


def test_gdpo_by_hand():
    """G = 2. a: group 1 [0, 1] -> [-1/sqrt2, 1/sqrt2] (unbiased std 1/sqrt2), group 2 [1, 1]
    -> [0, 0]; b: [10, 0] -> [1/sqrt2, -1/sqrt2], [3, 5] -> [-1/sqrt2, 1/sqrt2]. Sum:
    [0, 0, -1/sqrt2, 1/sqrt2]; over the batch (mean 0, std 1/sqrt3): [0, 0, -sqrt(3/2), sqrt(3/2)]."""
    components = {"a": [0.0, 1.0, 1.0, 1.0], "b": [10.0, 0.0, 3.0, 5.0]}
    s = 1 / math.sqrt(2)
    out = gdpo_advantages(components, group_size=2, batch_normalise=False, eps=0.0)
    assert out.normalised["a"].tolist() == pytest.approx([-s, s, 0, 0])
    assert out.normalised["b"].tolist() == pytest.approx([s, -s, -s, s])
    assert out.total.tolist() == pytest.approx([0, 0, -s, s])
    normed = gdpo_advantages(components, group_size=2, eps=0.0)
    r = math.sqrt(1.5)
    assert normed.total.tolist() == pytest.approx([0, 0, -r, r])
    assert normed.components["b"].tolist() == [10.0, 0.0, 3.0, 5.0]  # raw rewards kept for logging


def test_gdpo_separates_what_the_summed_reward_collapses():
    """Two binary rewards, two groups: (1,0) vs (0,0) and (1,1) vs (0,0). Summed then
    normalised, both groups get the same advantages; GDPO rewards satisfying both more."""
    from mmrl.algos.advantages import group_advantages

    components = {"format": [1.0, 0.0, 1.0, 0.0], "correct": [0.0, 0.0, 1.0, 0.0]}
    summed = group_advantages(weighted_sum(components).total, group_size=2)
    assert summed[0] == pytest.approx(summed[2]) and summed[1] == pytest.approx(summed[3])
    gdpo = gdpo_advantages(components, group_size=2, batch_normalise=False).total.tolist()
    assert gdpo[2] == pytest.approx(2 * gdpo[0], rel=1e-4) and gdpo[2] > gdpo[0] > 0


def test_combination_errors_are_named():
    with pytest.raises(ValueError, match="differ in length"):
        weighted_sum({"a": [1.0], "b": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"no weight for \['b'\]"):
        weighted_sum({"a": [1.0], "b": [1.0]}, {"a": 1.0})
    with pytest.raises(ValueError, match="'a' has non-finite"):
        weighted_sum({"a": [float("nan")]})
    with pytest.raises(ValueError, match="do not split into groups"):
        gdpo_advantages({"a": [1.0, 2.0, 3.0]}, group_size=2)


# --- configs -------------------------------------------------------------------------------


def test_typed_configs_match_the_constructors():
    """Every typed-config field is a constructor argument of its reward model."""
    from mmrl.rewards.catalog import _REGISTRY  # the catalog registers the built-in models

    for name, typed in config_module.TYPED_CONFIGS.items():
        params = inspect.signature(_REGISTRY[name]).parameters
        for f in dataclasses.fields(typed):
            assert f.name in params, f"{typed.__name__}.{f.name} is not an argument of {name}"


def test_build_reward_models_checks_keys():
    cfg = ModelRewardsConfig(
        models=[
            RewardModelConfig(name="jpeg_compressibility", kwargs={"quality": 80}),
            RewardModelConfig(name="incomp", type="jpeg_incompressibility"),
        ]
    )
    models = build_reward_models(cfg)
    assert list(models) == ["jpeg_compressibility", "incomp"]
    assert models["jpeg_compressibility"].quality == 80 and models["incomp"].name == "incomp"
    with pytest.raises(ValueError, match=r"reward.models\[0\].kwargs: unknown key\(s\) \['qualty'\]"):
        build_reward_models(
            ModelRewardsConfig(models=[RewardModelConfig(name="jpeg_compressibility", kwargs={"qualty": 1})])
        )
    with pytest.raises(ValueError, match="configured twice"):
        build_reward_models(
            ModelRewardsConfig(models=[RewardModelConfig(name="ocr", type="jpeg_compressibility")] * 2)
        )
    assert check_kwargs("aesthetic", {"dtype": "bfloat16"})["dtype"] is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float77'"):
        check_kwargs("aesthetic", {"dtype": "float77"})


# --- the router bridge ---------------------------------------------------------------------


class _Length(RewardModel):
    """Reward = response length (+ a bonus field), with a component."""

    def score_with_components(self, images=None, prompts=None, responses=None, **fields):
        from mmrl.rewards.base import RewardOutput

        self.check_inputs(images, prompts, responses, fields)
        self.calls.append({"images": images, "prompts": prompts, "responses": responses, **fields})
        bonus = fields.get("bonuss", [0] * len(responses))
        scores = [len(r) + (b or 0) for r, b in zip(responses, bonus)]
        return RewardOutput(
            scores=[float(s) for s in scores], components={"chars": [float(len(r)) for r in responses]}
        )

    def __init__(self):
        super().__init__()
        self.calls = []


class _FakeJudge(_Length):
    name = "vlm_judge"  # the judge's registered type: its reference defaults to the ground truth


def _sample(i, models=None, image=None, truth="4"):
    return Sample(
        data_source="t",
        prompt=[{"role": "user", "content": ("<image>" if image else "") + f"question {i}"}],
        images=[image] if image else [],
        ability="x",
        reward_model=RewardSpec(ground_truth=truth, verifier="math", models=models or []),
        extra_info={"id": f"s{i}"},
    )


def test_bridge_scores_each_row_with_its_models_and_weights():
    length, judge = _Length(), _FakeJudge()
    flat = Image.new("RGB", (32, 32), (128, 128, 128))
    samples = [
        _sample(0, [{"name": "length", "weight": 0.5}, {"name": "judge", "weight": 2.0}]),
        _sample(1, [{"name": "length", "weight": 1.0, "params": {"bonus": 10}}]),
        _sample(2),  # no model rewards
        _sample(3, ["jpeg"], image=flat),  # a bare name: weight 1, the sample's own image
    ]
    rows = score_model_rewards(
        samples,
        ["abcd", "ab", "xyz", "q"],
        None,
        {"length": length, "judge": judge, "jpeg": JpegCompressibility()},
    )
    jpeg = JpegCompressibility().score(images=[flat])[0]
    assert rows[0] == {
        "length": 4.0,
        "length/chars": 4.0,
        "judge": 4.0,
        "judge/chars": 4.0,
        "total": 0.5 * 4 + 2 * 4,
    }
    assert rows[1] == {"length": 12.0, "length/chars": 2.0, "total": 12.0}
    assert rows[2] == {}
    assert rows[3] == {"jpeg": jpeg, "jpeg/jpeg_kb": -jpeg, "total": jpeg}
    # One batched call per model; per-sample params arrive as per-item fields (bonus -> bonuss).
    assert len(length.calls) == 1 and length.calls[0]["bonuss"] == [None, 10]
    assert length.calls[0]["prompts"] == ["question 0", "question 1"]
    # The judge's reference defaults to the sample's ground truth.
    assert judge.calls[0]["references"] == ["4"]


def test_bridge_uses_generated_images_when_given():
    jpeg = JpegCompressibility()
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    flat = torch.full((3, 64, 64), 0.5)
    samples = [_sample(i, [{"name": "jpeg"}]) for i in range(2)]
    rows = score_model_rewards(samples, None, [flat, noise], {"jpeg": jpeg})
    assert rows[0]["jpeg"] > rows[1]["jpeg"]
    assert [r["jpeg"] for r in rows] == jpeg.score(images=[flat, noise])


def test_bridge_errors_name_the_sample_and_field():
    with pytest.raises(KeyError, match=r"sample s0: reward model 'aesthetic' is not configured"):
        score_model_rewards([_sample(0, ["aesthetic"])], ["x"], None, {})
    with pytest.raises(ValueError, match=r"sample s0: reward_model.models\[0\].weight: must be a number"):
        score_model_rewards([_sample(0, [{"name": "a", "weight": "high"}])], ["x"], None, {})
    with pytest.raises(ValueError, match=r"models\[0\]: unknown key\(s\) \['wieght'\]"):
        check_model_entries([{"name": "a", "wieght": 1}])
    with pytest.raises(ValueError, match="listed twice"):
        check_model_entries(["a", "a"])
    with pytest.raises(
        RewardModelError, match=r"reward model 'jpeg' failed on samples \['s0'\].*needs 'images'"
    ):
        score_model_rewards([_sample(0, ["jpeg"])], ["x"], None, {"jpeg": JpegCompressibility()})
    with pytest.raises(ValueError, match="1 responses for 2 samples"):
        score_model_rewards([_sample(0), _sample(1)], ["x"], None, {})


def test_prompt_text_drops_placeholders():
    assert prompt_text(_sample(0, image=Image.new("RGB", (4, 4)))) == "question 0"
