"""The `visual_search` task's data and its cold start's demonstrations."""

from __future__ import annotations

import numpy as np
import torch

from mmrl.datasets.procedural import image_digest, make_samples
from mmrl.datasets.vision_reasoning import COLOURS
from mmrl.datasets.visual_search import SCALE, quarter_box, without_tools
from mmrl.environments import parse_tool_calls
from mmrl.rollout.multiturn import demonstration_batch
from mmrl.train.forward import response_logprobs


def _colour_share(image, colour: str) -> float:
    """The fraction of pixels within 40 of `colour` on every channel."""
    pixels = np.asarray(image, dtype=np.int16)
    return float((np.abs(pixels - np.array(COLOURS[colour])).max(axis=-1) <= 40).mean())


def test_samples_name_the_zoom_tool_and_the_splits_share_no_image():
    train = make_samples(["visual_search"], 40, "train")
    heldout = make_samples(["visual_search"], 40, "heldout")
    assert not {image_digest(s.images[0]) for s in train} & {image_digest(s.images[0]) for s in heldout}
    for s in train:
        assert s.agent is not None and s.agent.tools == ["zoom_in"]
        assert s.images[0].size == (64 * SCALE, 64 * SCALE)
        call, answer = s.extra_info["tool_demonstration"]
        (parsed,) = parse_tool_calls(call).calls
        assert parsed.name == "zoom_in" and parsed.arguments["bbox_2d"] == quarter_box(
            s.extra_info["asked"], 256
        )
        assert answer == s.extra_info["reference"] == f"\\boxed{{{s.reward_model.ground_truth}}}"
        plain = without_tools(s)
        assert plain.agent is None and "zoom_in" not in plain.prompt[0]["content"]


def test_the_zoom_box_shows_the_asked_shape_large_and_the_whole_image_small():
    """At the model's input size (the processor makes every image 64x64) the asked shape's colour
    covers at most 3% of the image (the shape and specks); in the zoom box the shape alone covers
    at least 15% (a triangle; a square about 36%)."""
    for s in make_samples(["visual_search"], 20, "validation"):
        image = s.images[0]
        colour = s.extra_info["colours"][s.extra_info["asked"]]
        crop = image.crop(quarter_box(s.extra_info["asked"], image.size[0]))
        assert _colour_share(crop, colour) > 0.15
        small = image.resize((64, 64), resample=3)
        assert _colour_share(small, colour) < 0.03


def test_demonstrations_are_laid_out_as_the_loop_lays_out_a_trajectory(tiny_policy):
    samples = make_samples(["visual_search"], 3, "train")
    turns = [list(s.extra_info["tool_demonstration"]) for s in samples[:2]] + [
        [samples[2].extra_info["reference"]]
    ]
    rows = samples[:2] + [without_tools(samples[2])]
    tok = tiny_policy.processor.tokenizer
    stop = tiny_policy.stop_token_ids[0]
    batch = demonstration_batch(tiny_policy.processor, rows, turns, stop, tiny_policy.pad_token_id)
    for r in range(2):
        ids = batch.response_ids[r][batch.response_attention()[r].bool()].tolist()
        call = tok(turns[r][0], add_special_tokens=False)["input_ids"] + [stop]
        answer = tok(turns[r][1], add_special_tokens=False)["input_ids"] + [stop]
        assert ids[: len(call)] == call and ids[-len(answer) :] == answer
        assert batch.trajectories[r].turns == 2 and len(batch.trajectories[r].images) == 1
        assert batch.images_per_row[r] == 2
        assert int(batch.response_mask[r].sum()) == len(call) + len(answer)
    assert batch.images_per_row[2] == 1 and batch.observation_mask[2].sum() == 0
    with torch.no_grad():
        logprobs, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    assert torch.isfinite(logprobs).all() and (logprobs[batch.observation_mask.bool()] == 0).all()
