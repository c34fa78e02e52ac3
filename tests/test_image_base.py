"""The built-in image base and the GenEval-style reward, without training anything for long:
the pixel "VAE" is exact, the word tokenizer covers the grammar, the flow-matching loss is the
formula, the warm-up is reproducible by seed and cached, the `geneval` reward scores drawings,
and `mmrl train --task text_to_image`'s path (warm-up, reward, held-out accuracy, grids) runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmrl.datasets.geneval import VOCABULARY, all_specs, draw, geneval_prompts, parse_prompt, prompt_text
from mmrl.models.image_base import (
    ImageWarmupConfig,
    builtin_image_base,
    drawings_to_latents,
    flow_matching_loss,
    image_base_key,
    warm_up_image_base,
)
from mmrl.models.tiny_diffusion import build_tiny_pipeline, build_word_tokenizer
from mmrl.rewards import get_reward_model
from mmrl.rewards.base import RewardModelError
from mmrl.stats import wilson_interval
from mmrl.train.flow_config import load_flow_config
from mmrl.verifiers.geneval import prompt_following

SPEC = load_flow_config("text_to_image").model.tiny
QUICK = ImageWarmupConfig(max_steps=2, batch_size=4, eval_every=1, eval_size=3, eval_num_steps=2)


def test_the_recipe_is_the_image_base_with_the_geneval_reward():
    cfg = load_flow_config("text_to_image")
    assert cfg.model.base == "geneval" and cfg.reward.names == ["geneval"] and cfg.data.builtin == "geneval"
    assert (SPEC.vae, SPEC.tokenizer, SPEC.resolution) == ("pixel", "words", 32)
    with pytest.raises(ValueError, match="model.base must be random or geneval"):
        load_flow_config("text_to_image", overrides=["model.base=pretrained"])
    with pytest.raises(ValueError, match="must be sd3"):
        load_flow_config("text_to_image", overrides=["model.tiny.family=flux"])


def test_the_pixel_vae_is_the_identity():
    pipe = build_tiny_pipeline(SPEC, seed=0)
    assert pipe.vae_scale_factor == 1
    rng = np.random.default_rng(0)
    images = np.stack([np.asarray(draw(s, rng, 32)) for s in all_specs()[:8]])
    latents = drawings_to_latents(pipe, images, torch.device("cpu"))
    assert latents.shape == (8, 3, 32, 32) and 0.3 < float(latents.std()) < 1.0
    vae = pipe.vae.config
    decoded = pipe.vae.decode(latents / vae.scaling_factor + vae.shift_factor).sample
    back = ((decoded + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.abs(back.astype(int) - images.astype(int)).max() <= 1


def test_the_word_tokenizer_covers_the_grammar():
    tok = build_word_tokenizer()
    unk = tok.unk_token_id
    for spec in all_specs(("single", "count", "position", "text")):
        ids = tok(prompt_text(spec))["input_ids"]
        assert unk not in ids and len(ids) <= SPEC.text_max_length - 1, prompt_text(spec)
    assert len(set(VOCABULARY)) == len(VOCABULARY) and tok("a pink circle")["input_ids"][1] == unk


def test_flow_matching_loss_is_the_formula():
    class Zero(torch.nn.Module):
        def forward(self, hidden_states, **kw):
            return (torch.zeros_like(hidden_states),)

    x0, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    loss = flow_matching_loss(Zero(), x0, (None, None), torch.tensor([0.3, 0.8]), noise)
    assert loss.item() == pytest.approx(float((noise - x0).square().mean()))


@pytest.fixture(scope="module")
def quick_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("image-base-cache"))


def test_warm_up_is_reproducible_cached_and_leaves_the_rng_alone(quick_cache):
    from mmrl.models.tiny_diffusion import load_flow_pipeline

    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    path = builtin_image_base(SPEC, QUICK, quick_cache)
    assert torch.rand(1) == expected  # the warm-up drew from its own generators only
    report = json.loads((path / "warmup.json").read_text())
    assert report["steps"] == 2 and [h["step"] for h in report["history"]] == [1, 2]
    assert {"loss", "accuracy", "score", "accuracy/position"} <= set(report["history"][0])
    stamp = (path / "warmup.json").stat().st_mtime_ns
    assert builtin_image_base(SPEC, QUICK, quick_cache) == path
    assert (path / "warmup.json").stat().st_mtime_ns == stamp  # found in the cache, not rebuilt
    # The same settings give the same weights, also validated only at the end: a validation
    # draws from nothing training uses (the learning tests' base validates once, at its end).
    again, _ = warm_up_image_base(SPEC, ImageWarmupConfig(**{**QUICK.__dict__, "eval_every": 2}))
    saved = load_flow_pipeline(path).transformer.state_dict()
    for name, value in again.transformer.state_dict().items():
        assert torch.equal(value, saved[name]), name
    other = ImageWarmupConfig(**{**QUICK.__dict__, "seed": 1})
    assert image_base_key(SPEC, other, 8) != image_base_key(SPEC, QUICK, 8)


def test_warm_up_never_sees_held_out_prompts(monkeypatch):
    """The warm-up draws training prompts only: every prompt it draws or validates on, recorded
    during a short warm-up of every kind, is outside the held-out split (whose single-object
    prompts are the withheld colour-shape pairs)."""
    from mmrl.datasets import geneval

    kinds = ("single", "count", "position")
    heldout = set(geneval_prompts("heldout", kinds))
    assert {"a red square", "two red squares"} <= heldout
    drawn, parse = [], geneval.parse_prompt
    monkeypatch.setattr(geneval, "parse_prompt", lambda p: drawn.append(p) or parse(p))
    warm_up_image_base(
        SPEC,
        ImageWarmupConfig(
            max_steps=3, batch_size=64, eval_every=3, eval_size=24, eval_num_steps=1, kinds=list(kinds)
        ),
    )
    assert len(set(drawn)) > 50 and not set(drawn) & heldout


def test_geneval_reward_scores_drawings_and_names_bad_prompts():
    reward = get_reward_model("geneval")
    rng = np.random.default_rng(1)
    prompts = ["two red circles", "a blue square left of a green triangle", "a cyan triangle"]
    images = torch.stack(
        [torch.from_numpy(np.array(draw(parse_prompt(p), rng, 32))).permute(2, 0, 1) for p in prompts]
    )
    out = reward.score_with_components(images=images.float() / 255, prompts=prompts)
    assert out.scores == [1.0, 1.0, 1.0] and out.components["correct"] == [1.0, 1.0, 1.0]
    swapped = ["three red circles", "a blue square right of a green triangle", "a cyan circle"]
    out = reward.score_with_components(images=images, prompts=swapped)
    # count wrong (1 + 0 + 2/3) / 3; position wrong 6 / 7; shape wrong 2 / 3
    assert out.scores == pytest.approx([(1 + 0 + 2 / 3) / 3, 6 / 7, 2 / 3])
    assert get_reward_model("geneval", strict=True).score(images=images, prompts=swapped) == [0.0, 0.0, 0.0]
    with pytest.raises(RewardModelError, match="prompt 1"):
        reward.score(images=images, prompts=["a red circle", "a red cat", "a red circle"])
    accuracy = prompt_following(images.float() / 255, swapped[:1] + prompts[1:])
    assert accuracy["accuracy"] == pytest.approx(2 / 3) and accuracy["accuracy/count"] == 0.0


def test_text_to_image_trains_the_image_base_and_reports_heldout_accuracy(tmp_path, quick_cache):
    from mmrl.train.flow_grpo import run_text_to_image
    from mmrl.train.metrics_log import read_metrics

    quick = [f"model.warmup.{k}={v}" for k, v in QUICK.__dict__.items() if k != "kinds"]
    cfg = load_flow_config(
        "text_to_image",
        overrides=[
            *quick,
            f"model.cache_dir={quick_cache}",  # the base of the test above
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.total_steps=1",
            "trainer.prompts_per_step=2",
            "trainer.eval_size=3",
            "trainer.train_eval_size=4",
            "trainer.progress=false",
            "trainer.save_final=false",
            "sample.group_size=2",
            "sample.num_steps=2",
            "sample.eval_num_steps=2",
        ],
    )
    result = run_text_to_image(cfg)
    assert result.start_accuracy is not None and result.final_accuracy is not None
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "eval/geneval/accuracy" in r] == [0, 1]
    # held-out and training-prompt accuracy side by side, each with its size and Wilson interval,
    # in the log and in the final line, with the images' edge noise
    line = result.summary_line()
    for r, figures in ((records[0], result.start_eval), (records[-1], result.final_eval)):
        for prefix, name, n in (("eval/geneval/", "", 3), ("eval/geneval/train/", "train_", 4)):
            accuracy, n_seen = r[f"{prefix}accuracy"], r[f"{prefix}n"]
            low, high = wilson_interval(round(accuracy * n_seen), int(n_seen))
            assert n_seen == n and (r[f"{prefix}accuracy_low"], r[f"{prefix}accuracy_high"]) == (low, high)
            assert figures[f"{name}accuracy"] == accuracy and figures[f"{name}n"] == n
            assert f"{accuracy:.1%} [{100 * low:.1f}-{100 * high:.1f}]" in line
        assert r["eval/geneval/edge_noise"] >= 0 and f"{figures['edge_noise']:.1f}" in line
    assert "held-out GenEval accuracy" in line and "training prompts" in line and "3 images each" in line
    step1 = next(r for r in records if r["step"] == 1)
    assert "reward/geneval/mean" in step1
    # each attribute's mean over the batch is logged (what RL is, and is not, improving)
    for part in ("correct", "colour", "count", "shape", "shape_fit", "position", "clean"):
        assert 0.0 <= step1[f"reward/geneval/{part}"] <= 1.0, part
        assert f"eval/reward/geneval/{part}" in records[0], part
    assert step1["reward/geneval/noise"] >= 0.0
    assert sorted(p.name for p in (result.run_dir / "images").glob("*.png")) == [
        "eval_step_00000.png",
        "eval_step_00001.png",
    ]
