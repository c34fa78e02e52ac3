"""The built-in task: deterministic, held-out split disjoint, answers only in the image."""

from __future__ import annotations

from collections import defaultdict

import pytest

from mmrl.datasets.procedural import image_digest, make_samples
from mmrl.datasets.vision_reasoning import KINDS
from mmrl.verifiers import get_verifier


def test_generation_is_deterministic_by_seed():
    a = make_samples(list(KINDS), 12, "train", seed=5)
    b = make_samples(list(KINDS), 12, "train", seed=5)
    c = make_samples(list(KINDS), 12, "train", seed=6)
    assert [image_digest(s.images[0]) for s in a] == [image_digest(s.images[0]) for s in b]
    assert [image_digest(s.images[0]) for s in a] != [image_digest(s.images[0]) for s in c]


def test_heldout_images_never_appear_in_training():
    train = {image_digest(s.images[0]) for s in make_samples(["colour_code"], 4096, "train")}
    heldout = [image_digest(s.images[0]) for s in make_samples(["colour_code"], 512, "heldout")]
    assert not train.intersection(heldout)


@pytest.mark.parametrize("kind", KINDS)
def test_the_question_text_does_not_give_the_answer_away(kind):
    """For every question text, several different answers occur: only the image decides."""
    answers_by_question = defaultdict(list)
    for s in make_samples([kind], 300, "train"):
        answers_by_question[s.prompt[0]["content"]].append(s.reward_model.ground_truth)
    frequent = {q: a for q, a in answers_by_question.items() if len(a) >= 10}
    assert frequent
    for answers in frequent.values():
        assert len(set(answers)) >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_the_ground_truth_is_checked_by_the_math_verifier(kind):
    verifier = get_verifier("math")
    for s in make_samples([kind], 10, "train"):
        verifier.check_sample(s)
        gold = s.reward_model.ground_truth
        assert verifier(f"\\boxed{{{gold}}}", s).components["accuracy"] == 1.0
        assert verifier(f"\\boxed{{{int(gold) + 1}}}", s).components["accuracy"] == 0.0


def test_colour_code_answers_are_balanced():
    counts = defaultdict(int)
    for s in make_samples(["colour_code"], 600, "heldout"):
        counts[s.reward_model.ground_truth] += 1
    assert sorted(counts) == ["1", "2", "3", "4", "5", "6"]
    assert min(counts.values()) > 600 / 6 * 0.7  # no answer is rare: chance is 1/6
