"""The flow-GRPO sampler over real diffusers pipelines (tiny SD3 and FLUX built from config)."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.models.tiny_diffusion import (
    TinyDiffusionSpec,
    build_tiny_pipeline,
    builtin_pipeline_path,
    load_flow_pipeline,
    pipeline_family,
)
from mmrl.rollout.diffusion import FlowSampler, choose_sde_steps

PROMPTS = ["a red cat on a table", "two blue boats at night"]


@pytest.fixture(scope="module")
def sd3():
    pipe = build_tiny_pipeline(TinyDiffusionSpec(family="sd3"), seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def flux():
    pipe = build_tiny_pipeline(TinyDiffusionSpec(family="flux"), seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_images(pipe, prompts, steps, guidance, seed):
    kwargs = dict(
        num_inference_steps=steps,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        max_sequence_length=8,
    )
    if pipeline_family(pipe) == "flux":
        if guidance > 1:
            kwargs.update(negative_prompt=[""] * len(prompts), true_cfg_scale=guidance)
    else:
        kwargs["guidance_scale"] = guidance
    return pipe(prompts, **kwargs).images


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_ode_mode_reproduces_the_pipelines_own_output(family, guidance, request):
    pipe = request.getfixturevalue(family)
    sampler = FlowSampler(pipe, max_sequence_length=8)
    prompts = PROMPTS * 2
    expected = _pipeline_images(pipe, prompts, 6, guidance, seed=3)
    traj = sampler.sample(
        prompts, 6, 64, 64, guidance_scale=guidance, generator=torch.Generator().manual_seed(3), sde_steps=()
    )
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-6)
    assert traj.sde_steps == [] and torch.isnan(traj.log_probs).all()
    assert traj.latents.shape[:2] == (4, 7)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_rollout_log_probs_equal_the_recomputation_from_stored_latents(family, request):
    pipe = request.getfixturevalue(family)
    sampler = FlowSampler(pipe, max_sequence_length=8)
    guidance = 3.0
    traj = sampler.sample(
        PROMPTS * 2, 5, 64, 64, guidance_scale=guidance, generator=torch.Generator().manual_seed(0)
    )
    assert traj.sde_steps == list(range(5)) and torch.isfinite(traj.log_probs).all()
    for rows in ([0, 1, 2, 3], [2, 0]):
        cond = traj.cond.select(rows)
        for j in traj.sde_steps:
            out = sampler.step_log_prob(
                pipe.transformer, traj, rows, j, cond, guidance, 0.7, height=64, width=64
            )
            torch.testing.assert_close(out.log_prob, traj.log_probs[rows, j], rtol=0, atol=1e-6)


def test_sde_window_ode_elsewhere_and_determinism(sd3):
    sampler = FlowSampler(sd3, max_sequence_length=8)
    run = [
        sampler.sample(PROMPTS, 8, 64, 64, generator=torch.Generator().manual_seed(5), sde_steps=[2, 3])
        for _ in range(2)
    ]
    assert torch.equal(run[0].latents, run[1].latents)  # same seed, same trajectory
    lp = run[0].log_probs
    assert torch.isfinite(lp[:, 2:4]).all() and torch.isnan(lp[:, [0, 1, 4, 5, 6, 7]]).all()
    # before the window it is the ODE sampler's trajectory
    ode = sampler.sample(PROMPTS, 8, 64, 64, generator=torch.Generator().manual_seed(5), sde_steps=())
    assert torch.equal(run[0].latents[:, :3], ode.latents[:, :3])
    assert not torch.equal(run[0].latents[:, 4], ode.latents[:, 4])


def test_choose_sde_steps():
    assert choose_sde_steps(10) == list(range(10))
    g = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(200):
        w = choose_sde_steps(10, 2, [1, 6], g)
        assert len(w) == 2 and w[1] == w[0] + 1 and 1 <= w[0] and w[1] < 6
        starts.add(w[0])
    assert starts == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="does not fit"):
        choose_sde_steps(10, 4, [0, 3])


def test_schedule_starts_at_sigma_one_and_the_first_sde_step_is_finite(sd3):
    sampler = FlowSampler(sd3, max_sequence_length=8)
    _, sigmas = sampler.schedule(10, 64, 64)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    traj = sampler.sample(PROMPTS, 10, 64, 64, generator=torch.Generator().manual_seed(0), sde_steps=[0])
    assert torch.isfinite(traj.log_probs[:, 0]).all() and torch.isfinite(traj.latents).all()


def test_cps_sampling_log_probs_recompute(sd3):
    sampler = FlowSampler(sd3, max_sequence_length=8)
    traj = sampler.sample(PROMPTS, 4, 64, 64, generator=torch.Generator().manual_seed(0), sde_type="cps")
    for j in range(4):
        out = sampler.step_log_prob(sd3.transformer, traj, [0, 1], j, traj.cond, 1.0, 0.7, "cps")
        torch.testing.assert_close(out.log_prob, traj.log_probs[:, j], rtol=0, atol=1e-6)
    # CPS's last step is deterministic: s = sigma' sin(a pi / 2) = 0, log-prob -(x' - mean)^2 = 0
    assert torch.equal(traj.log_probs[:, -1], torch.zeros(2))


def test_saved_pipeline_loads_offline_with_diffusers_and_samples_the_same(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    spec = TinyDiffusionSpec(family="sd3")
    path = builtin_pipeline_path(spec, seed=0, cache_dir=str(tmp_path))
    assert path == builtin_pipeline_path(spec, seed=0, cache_dir=str(tmp_path))  # built once
    direct = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)
    loaded = load_flow_pipeline(path)
    built = build_tiny_pipeline(spec, seed=0)
    images = []
    for pipe in (direct, loaded, built):
        pipe.set_progress_bar_config(disable=True)
        images.append(_pipeline_images(pipe, PROMPTS, 4, 1.0, seed=1))
    assert torch.equal(images[0], images[1]) and torch.equal(images[0], images[2])
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_flow_pipeline(tmp_path / "nothing")


def test_tiny_spec_errors_are_clear():
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny_pipeline(TinyDiffusionSpec(family="sdxl"))
    with pytest.raises(ValueError, match="multiple of 16"):
        build_tiny_pipeline(TinyDiffusionSpec(resolution=40))
    with pytest.raises(ValueError, match="unsupported pipeline"):
        pipeline_family(object())


def test_images_are_in_unit_range_and_log_probs_per_sample(sd3):
    sampler = FlowSampler(sd3, max_sequence_length=8)
    traj = sampler.sample(PROMPTS * 3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert traj.images.shape == (6, 3, 64, 64)
    assert 0.0 <= float(traj.images.min()) and float(traj.images.max()) <= 1.0
    assert traj.log_probs.shape == (6, 3)
    # log-prob of the sampler's own draw: about -log(std) - log sqrt(2 pi) - 1/2 per element
    s = traj.sigmas.tolist()
    std0 = 0.7 * math.sqrt(1.0 / (1 - s[1])) * math.sqrt(s[0] - s[1])
    expected = -math.log(std0) - 0.5 * math.log(2 * math.pi) - 0.5
    assert float(traj.log_probs[:, 0].mean()) == pytest.approx(expected, abs=0.05)
