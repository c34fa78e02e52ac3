"""DDPO's JPEG rewards and the reward-model registry / base API they sit on."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.rewards import RewardModelError, get_reward_model, reward_model_names
from mmrl.rewards.base import (
    RewardInputs,
    RewardModel,
    RewardOutput,
    as_pil_images,
    register_reward_model,
)
from mmrl.rewards.jpeg import JpegCompressibility


def _flat_and_noise() -> torch.Tensor:
    """[2, 3, 64, 64] in [0, 1]: a flat grey image and uniform noise."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.full((1, 3, 64, 64), 0.5), torch.rand(1, 3, 64, 64, generator=g)])


def test_compressibility_orders_flat_image_above_noise():
    images = _flat_and_noise()
    comp = get_reward_model("jpeg_compressibility").score(images=images)
    incomp = get_reward_model("jpeg_incompressibility").score(images=images)
    assert comp[0] > comp[1]  # flat compresses better: higher compressibility reward
    assert incomp[1] > incomp[0]
    assert comp == [-s for s in incomp]
    assert all(s < 0 for s in comp)


def test_size_is_kilobytes_at_quality_95_as_ddpo():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    out = get_reward_model("jpeg_incompressibility").score_with_components(images=[image])
    assert out.scores == [buffer.tell() / 1000]
    assert out.components == {"jpeg_kb": [buffer.tell() / 1000]}


def test_image_forms_agree():
    """Float tensor [N,3,H,W], uint8 array [N,H,W,3] and PIL images give the same score."""
    images = _flat_and_noise()
    uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8)
    model = JpegCompressibility()
    as_tensor = model.score(images=images)
    as_array = model.score(images=uint8.permute(0, 2, 3, 1).numpy())
    as_pil = model.score(images=[Image.fromarray(a) for a in uint8.permute(0, 2, 3, 1).numpy()])
    as_list_of_tensors = model.score(images=list(images))
    assert as_tensor == as_array == as_pil == as_list_of_tensors


def test_jpeg_stays_on_host_and_holds_no_weights():
    model = get_reward_model("jpeg_compressibility", quality=90)
    assert model.to("meta") is model and model.device == torch.device("cpu")
    assert model.memory_bytes() == 0
    assert model.quality == 90


def test_bad_inputs_are_named():
    model = get_reward_model("jpeg_compressibility")
    with pytest.raises(RewardModelError, match="needs 'images'"):
        model.score(prompts=["a"])
    with pytest.raises(RewardModelError, match="differ in length"):
        model.score(images=_flat_and_noise(), prompts=["only one"])
    with pytest.raises(RewardModelError, match=r"\[N, 3, H, W\]"):
        as_pil_images(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="quality"):
        get_reward_model("jpeg_compressibility", quality=0)


def test_registry():
    names = reward_model_names()
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(names)
    with pytest.raises(KeyError, match="unknown reward model 'nope'"):
        get_reward_model("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward_model("jpeg_compressibility")(JpegCompressibility)


def test_a_subclass_needs_only_score():
    class Length(RewardModel):
        requires = ("responses",)

        def score(self, images=None, prompts=None, responses=None, **fields):
            self.check_inputs(images, prompts, responses, fields)
            return [float(len(r)) for r in responses]

    model = Length()
    model.name = "length"
    assert model(responses=["ab", "c"]) == [2.0, 1.0]
    assert model.score_with_components(responses=["ab"]) == RewardOutput([2.0], {"length": [2.0]})
    with pytest.raises(NotImplementedError):
        RewardModel().score(responses=["x"])


def test_score_inputs_gets_the_checked_inputs_with_the_images_decoded_once():
    class Seen(RewardModel):
        requires = ("images", "texts")

        def score_inputs(self, x: RewardInputs) -> RewardOutput:
            self.seen = x
            return RewardOutput([float(im.size[0]) for im in x.images])

    model = Seen()
    images = _flat_and_noise()
    assert model.score(images=images, texts=["a", "b"]) == [64.0, 64.0]
    x = model.seen
    assert x.n == 2 and x.prompts is None and x.responses is None and x.fields == {"texts": ["a", "b"]}
    assert [im.mode for im in x.images] == ["RGB", "RGB"]
    assert [np.asarray(im) for im in x.images][1].tolist() == np.asarray(as_pil_images(images)[1]).tolist()
    # The checks run before score_inputs: a missing required input, or lengths that differ.
    with pytest.raises(RewardModelError, match="needs 'texts'"):
        model.score(images=images)
    with pytest.raises(RewardModelError, match="differ in length"):
        model.score(images=images, texts=["a"])


def fresh_python(code: str) -> str:
    """Run `code` in a new interpreter (nothing imported yet); return what it printed."""
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


LOOKUPS = {
    "mmrl.rewards": "from mmrl.rewards import get_reward_model as lookup",
    "mmrl.rewards.catalog": "from mmrl.rewards.catalog import get_reward_model as lookup",
    "mmrl.rewards.config": (
        "from mmrl.rewards.catalog import build_reward_models\n"
        "from mmrl.rewards.config import ModelRewardsConfig, RewardModelConfig\n"
        "cfg = ModelRewardsConfig(models=[RewardModelConfig(name='jpeg_compressibility')])\n"
        "lookup = lambda name: build_reward_models(cfg)[name]"
    ),
}


@pytest.mark.parametrize("path", sorted(LOOKUPS))
def test_a_built_in_model_is_found_from_every_public_import_path(path):
    # The registry (rewards/base.py) imports no model: the models import it, and the lookups
    # live above them (rewards/catalog.py). Each path is tried in a fresh process, where
    # nothing else has imported the built-in models. Importing the package and its config
    # imports no torch (mmrl.config imports mmrl.rewards.config; a config error must be instant).
    code = (
        "import sys\nimport mmrl.rewards, mmrl.rewards.config\nprint('torch' in sys.modules)\n"
        f"{LOOKUPS[path]}\nprint(type(lookup('jpeg_compressibility')).__name__)"
    )
    assert fresh_python(code).split() == ["False", "JpegCompressibility"]
