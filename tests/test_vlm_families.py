"""Every VLM family goes through the same rollout, log-prob, update and save code.

One tiny random model per family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA 1.5 / NeXT / OneVision,
Idefics3, SmolVLM, Gemma 3, InternVL), built from config with its real processor, saved and
loaded back through `AutoModelForImageTextToText` / `AutoProcessor` as a user's checkpoint is.
The prompts hold one to three images of two shapes, so the families' own layouts of vision
inputs are all exercised: tiles per image (LLaVA-NeXT / OneVision, InternVL), images per row
padded to the batch's most (Idefics3, SmolVLM), patches per image grid (Qwen), token types
(Gemma 3, Qwen); the engine generates one group per chunk, so chunks of different shapes are
joined, and the update splits the rows into mini-batches again. Measured: 137 s of CPU time for
the ten families and the two small tests (12-32 s wall each on the 2-core machine under load).
The LLaVA learning test at the end is slow.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from mmrl.algos.advantages import group_advantages
from mmrl.config import load_config
from mmrl.models.adapters import merged_copy_for_saving, param_groups
from mmrl.models.families import family_of, shares_prompts
from mmrl.models.loading import load_policy
from mmrl.models.precision import adamw
from mmrl.models.tiny import TinyVLMSpec, architectures, build_processor, build_tiny_vlm
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.batching import select_rows
from mmrl.train.forward import response_logprobs
from mmrl.train.grpo import prepare_policy
from mmrl.train.update import update_policy
from mmrl.types import RewardSpec, Sample

# The adapter each family gets (mmrl.models.families); "generic" is the default.
FAMILY = {
    "qwen2_vl": "qwen_vl",
    "qwen2_5_vl": "qwen_vl",
    "qwen3_vl": "qwen_vl",
    "qwen3_vl_moe": "qwen_vl",
    "llava": "generic",
    "llava_next": "generic",
    "llava_onevision": "generic",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "gemma3": "generic",
    "internvl": "internvl",
}


def _samples() -> list[Sample]:
    red, blue = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "blue")
    wide = Image.new("RGB", (128, 64), "green")  # more tiles than a square one where families tile

    def sample(i, images, text):
        return Sample(
            "multi",
            [{"role": "user", "content": text}],
            images,
            "math",
            RewardSpec("1", "math"),
            {"id": str(i)},
        )

    return [
        sample(0, [red, wide], "<image>first, <image>second: which is red?"),
        sample(1, [blue], "<image>colour?"),
        sample(2, [wide, red, blue], "<image><image><image>count red"),
    ]


def test_every_listed_family_is_covered():
    assert set(FAMILY) == set(architectures())


@pytest.mark.parametrize("architecture", architectures())
def test_a_family_rolls_out_recomputes_its_logprobs_updates_and_reloads(architecture, tmp_path):
    spec = TinyVLMSpec(architecture=architecture)
    build_tiny_vlm(spec, seed=3).save_pretrained(tmp_path / "base")
    build_processor(spec).save_pretrained(tmp_path / "base")
    policy = load_policy(tmp_path / "base")  # through the Auto classes, as any checkpoint
    assert family_of(policy.model).name == FAMILY[architecture]
    assert shares_prompts(policy.model)
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            "trainer.mini_batches=2",
            "optim.lr=1e-3",
            "optim.vision_lr=2e-3",
            "optim.connector_lr=3e-3",
        ],
    )
    prepare_policy(cfg, policy)
    # Every part has its own group: the adapter finds the vision tower and the connector.
    optimizer = adamw(param_groups(policy.model, cfg), lr=cfg.optim.lr)
    assert [g["name"] for g in optimizer.param_groups] == ["language", "vision", "connector"]

    # 1. Rollout: G = 2 responses per prompt, one group per chunk (chunks of different shapes joined).
    engine = HFRolloutEngine.from_policy(policy, max_batch_rows=2)
    batch = engine.generate(_samples(), SamplingParams(n=2, max_new_tokens=6))
    assert batch.images_per_row == [2, 2, 1, 1, 3, 3]
    assert batch.response_mask.sum() > len(batch)
    counted = batch.response_ids[batch.response_mask.bool()]
    assert not policy.blocked[counted].any()  # no image token, nor any blocked one, was sampled
    assert policy.blocked[_image_token_id(policy.model)]

    # 2. The trainer's recomputation (plain, shared-prompt, and on a sub-batch) equals the rollout's.
    with torch.no_grad():
        plain, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0, share_prompts=False)
        shared, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
        part, _ = response_logprobs(policy.model, select_rows(batch, [5, 0, 2]), policy.blocked, 1.0)
    torch.testing.assert_close(plain, batch.rollout_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared, batch.rollout_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(part, batch.rollout_logprobs[[5, 0, 2]], atol=1e-5, rtol=0)

    # 2b. The model looks at its images: other pixels (noise wherever the processor put image
    #     values; the all-zero images that pad a row stay padding) change the response log-probs.
    #     Measured (seed 3): mean |change| per response token 0.12-0.19, max 0.34-0.81 over the
    #     eleven families; Gemma 3 was 0.0 before its builder drew the zero-initialised projector
    #     (`mmrl.models.tiny_families.draw_zero_initialised`). Bars: a fifth of the smallest.
    pixels = batch.vision_inputs["pixel_values"]
    noise = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(1), dtype=pixels.dtype)
    ablated = dataclasses.replace(
        batch, vision_inputs={**batch.vision_inputs, "pixel_values": torch.where(pixels != 0, noise, pixels)}
    )
    with torch.no_grad():
        blind, _ = response_logprobs(policy.model, ablated, policy.blocked, 1.0, share_prompts=False)
    change = (blind - plain)[batch.response_mask.bool()].abs()
    assert change.mean() > 0.02 and change.max() > 0.06, (float(change.mean()), float(change.max()))

    # 3. One update (two mini-batches): every part's weights move, and the surrogate objective
    #    rises (an Adam step has a positive inner product with the gradient).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    advantages = group_advantages(rewards, 2)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    update_policy(cfg, policy, optimizer, batch, advantages, plain, None)
    for group in optimizer.param_groups:
        names = [n for n, p in policy.model.named_parameters() if any(p is q for q in group["params"])]
        moved = [n for n in names if not torch.equal(before[n], dict(policy.model.named_parameters())[n])]
        assert moved, f"no {group['name']} weight changed"
    with torch.no_grad():
        after, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
    mask = batch.response_mask
    gain = ((after - plain) * mask).sum(1) / mask.sum(1)
    assert (gain * advantages).sum() > 0

    # 4. Save (as the trainer saves the final policy) and reload: same log-probs, same blocked ids.
    merged_copy_for_saving(policy.model).save_pretrained(tmp_path / "final")
    policy.processor.save_pretrained(tmp_path / "final")
    reloaded = load_policy(tmp_path / "final")
    assert torch.equal(reloaded.blocked, policy.blocked)
    with torch.no_grad():
        again, _ = response_logprobs(reloaded.model, batch, reloaded.blocked, 1.0)
    torch.testing.assert_close(again, after, atol=1e-6, rtol=0)


def _image_token_id(model) -> int:
    """The id whose embeddings the image features replace (the model config names it)."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


def test_where_the_shared_prompt_forward_does_not_apply_the_plain_one_runs_and_the_log_says_so_once(
    monkeypatch, caplog
):
    """A family adapter that says the shared-prompt forward does not apply (as the generic one
    says for an unregistered model with its own multimodal positions): rollout and trainer take
    the plain paths, give the plain forward's numbers, and the reason is logged once."""
    from mmrl.models import families

    class NoSharing(families.VLMFamily):
        model_types = ("llava",)

        def why_no_shared_prompts(self, model):
            return "a test family says so"

    monkeypatch.setattr(families, "_FAMILIES", [NoSharing, *families._FAMILIES])
    monkeypatch.setattr(families, "_said", set())
    spec = TinyVLMSpec(architecture="llava")
    from mmrl.models.loading import make_policy

    policy = make_policy(build_tiny_vlm(spec, seed=1), build_processor(spec))
    engine = HFRolloutEngine.from_policy(policy)
    with caplog.at_level("INFO", logger="mmrl.models.families"):
        batch = engine.generate(_samples()[1:], SamplingParams(n=2, max_new_tokens=5))
        with torch.no_grad():
            first, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
            second, _ = response_logprobs(policy.model, batch, policy.blocked, 1.0)
    torch.testing.assert_close(first, batch.rollout_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    said = [r.getMessage() for r in caplog.records if "shared-prompt forward off" in r.getMessage()]
    assert said == ["shared-prompt forward off, using the plain forward: a test family says so"]


def test_vision_inputs_the_layout_does_not_describe_are_refused_naming_the_input():
    """The bug this adapter replaced: a batch whose vision inputs are not one per row and whose
    layout does not say how they map to rows fails with the input's name, not a KeyError."""
    from dataclasses import replace

    from mmrl.models.loading import make_policy
    from mmrl.types import VisionLayout

    spec = TinyVLMSpec(architecture="qwen2_vl")
    policy = make_policy(build_tiny_vlm(spec, seed=1), build_processor(spec))
    batch = HFRolloutEngine.from_policy(policy).generate(
        _samples()[:2], SamplingParams(n=1, max_new_tokens=3)
    )
    select_rows(batch, [1])  # described: fine
    with pytest.raises(ValueError, match=r"vision input 'pixel_values' has \d+ entries for 2 rows"):
        select_rows(replace(batch, vision_layout=VisionLayout()), [1])


@pytest.mark.parametrize("architecture", architectures())
def test_lora_adapts_the_language_model_of_every_family_and_freezing_finds_its_parts(architecture):
    from mmrl.models.adapters import apply_lora, freeze_parts, part_of

    cfg = load_config("vision_reasoning", overrides=["model.lora_rank=4", "model.freeze_connector=true"])
    model = build_tiny_vlm(TinyVLMSpec(architecture=architecture))
    freeze_parts(model, cfg)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(part_of(n, model) == "connector" for n in frozen)
    model = apply_lora(model, cfg)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    # q, k, v, o, gate, up, down per layer; a MoE layer's experts are fused 3-D parameters that
    # LoRA's linear targets do not reach (its router is not a target either): q, k, v, o only.
    per_layer = 4 if architecture == "qwen3_vl_moe" else 7
    assert len(adapted) == per_layer * TinyVLMSpec().num_layers
    assert all(part_of(n, model) == "language" for n in adapted)


# The shortened recipe of test_families.py (60 steps at a constant learning rate, greedy held-out
# accuracy on 512 prompts at the ends) on a LLaVA 1.5 built-in base: a non-Qwen family learns the
# built-in task through the same loop. Its base is warmed up once per cache (a second base beside
# the Qwen one), for the 270 steps after which the default warm-up stops on this task (validating
# every 10 steps on 256 prompts: 27 validations of 0.86 CPU-seconds each). Here it validates
# once, at its end: the same weights, bit for bit (measured December 5, 2026), since a greedy
# validation draws from no generator the warm-up uses. The Qwen base shows the stop itself.
LLAVA_RECIPE = [
    "model.tiny.architecture=llava",
    "model.warmup.max_steps=270",
    "model.warmup.eval_every=270",
    "model.warmup.patience=1",
    "trainer.total_steps=60",
    "trainer.eval_every=60",
    "optim.schedule=constant",
    "trainer.progress=false",
    "trainer.save_final=false",
]
# Margin: the difference of two 512-prompt evaluations has a standard deviation of at most 3.1
# points (see test_families.py). Measured with this recipe (seed 0, the 2-core machine shared
# with other jobs): the base's warm-up stopped after 270 steps (Qwen2-VL's: 120); greedy held-out
# accuracy 45.1% -> 59.4% (step 30) -> 87.9% (step 60), +42.8 points. Only seed 0 was measured,
# so the margin is the GRPO one of test_families.py: about a third of that gain and ~5 standard
# deviations of the evaluation noise.
LLAVA_MIN_GAIN = 0.15


@pytest.mark.slow
def test_a_llava_base_learns_the_builtin_task(mmrl_cache, tmp_path):
    cfg = load_config("vision_reasoning", overrides=[*LLAVA_RECIPE, f"trainer.run_dir={tmp_path}"])
    from mmrl.train.grpo import train

    result = train(cfg)
    gain = result.final_accuracy - result.start_accuracy
    assert gain >= LLAVA_MIN_GAIN, f"{result.start_accuracy:.3f} -> {result.final_accuracy:.3f}"


def test_an_unregistered_model_with_its_own_multimodal_positions_gets_the_plain_forward(
    tiny_policy, monkeypatch, caplog
):
    # A Qwen2-VL seen as an unknown family (its adapter unregistered): the generic adapter sees
    # that the model lays out its own multimodal positions (get_rope_index), so it passes no
    # position ids and turns the shared-prompt forward off, saying why once per model class.
    import logging

    from mmrl.models import families

    monkeypatch.setattr(
        families, "_FAMILIES", [f for f in families._FAMILIES if f is not families.QwenVLFamily]
    )
    monkeypatch.setattr(families, "_said", set())
    model = tiny_policy.model
    assert type(families.family_of(model)) is families.VLMFamily
    inputs = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3, dtype=torch.long),
    }
    assert families.family_of(model).position_ids(model, inputs) is None
    with caplog.at_level(logging.INFO, logger=families.__name__):
        assert families.shares_prompts(model) is False
        assert families.shares_prompts(model) is False
    said = [r.getMessage() for r in caplog.records if "shared-prompt forward off" in r.getMessage()]
    assert len(said) == 1 and "lays out its own multimodal positions" in said[0]
    # Registered again, Qwen2-VL's own adapter shares prompts.
    monkeypatch.undo()
    assert families.shares_prompts(model) is True
