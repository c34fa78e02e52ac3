"""The built-in perception kinds: boxes that fit the drawn shapes, references that score 1."""

from __future__ import annotations

import pytest

from mmrl.datasets.perception import WORDS
from mmrl.datasets.procedural import image_digest, kinds, make_samples, reference_response
from mmrl.types import VerifyContext
from mmrl.verifiers import get_verifier

PERCEPTION = ["detection", "grounding", "ocr", "counting"]


@pytest.mark.parametrize("kind", PERCEPTION)
def test_the_reference_response_scores_full_marks_with_the_named_verifier(kind):
    for sample in make_samples([kind], 20, "train"):
        verifier = get_verifier(sample.reward_model.verifier)
        verifier.check_sample(sample)
        result = verifier(reference_response(sample), sample, VerifyContext(0, 10))
        assert result.error is None
        assert result.components["accuracy"] == pytest.approx(1.0, abs=1e-6)


def test_detection_boxes_enclose_every_drawn_shape():
    """Every pixel that differs from the background lies inside a ground-truth box (1 px slack),
    and every box holds shape pixels."""
    for sample in make_samples(["detection"], 40, "heldout"):
        image = sample.pil_images()[0]
        background = max(image.getcolors(4096))[1]  # the most frequent colour
        boxes = [b["bbox_2d"] for b in sample.reward_model.ground_truth]
        hits = [0] * len(boxes)
        for y in range(image.height):
            for x in range(image.width):
                if max(abs(a - b) for a, b in zip(image.getpixel((x, y)), background)) <= 40:
                    continue
                inside = [
                    i
                    for i, (x1, y1, x2, y2) in enumerate(boxes)
                    if x1 - 1 <= x <= x2 + 1 and y1 - 1 <= y <= y2 + 1
                ]
                assert inside, f"{sample.id}: shape pixel ({x}, {y}) outside every box {boxes}"
                for i in inside:
                    hits[i] += 1
        assert all(h > 20 for h in hits)


def test_perception_kinds_are_registered_with_their_own_streams():
    registered = kinds()
    assert {k: registered[k].task for k in PERCEPTION} == {k: "perception" for k in PERCEPTION}
    assert len({k.stream for k in registered.values()}) == len(registered)


def test_ocr_words_and_counts_vary_and_the_question_does_not_give_them_away():
    ocr = make_samples(["ocr"], 200, "train")
    assert len({s.prompt[0]["content"] for s in ocr}) == 1
    assert len({s.reward_model.ground_truth for s in ocr}) > len(WORDS) // 2
    counting = make_samples(["counting"], 120, "train")
    assert {s.reward_model.ground_truth for s in counting} == {1, 2, 3, 4, 5, 6}


def test_splits_share_no_image():
    train = {image_digest(s.images[0]) for s in make_samples(PERCEPTION, 800, "train")}
    heldout = {image_digest(s.images[0]) for s in make_samples(PERCEPTION, 200, "heldout")}
    assert not train & heldout
