"""Reward hacking against the math verifier: each test is a response a policy could learn to
write for reward without being right, and must not be credited (or is credited only when the
answer really is what it claims)."""

from __future__ import annotations

import pytest

from mmrl.types import RewardSpec, Sample
from mmrl.verifiers import get_verifier
from mmrl.verifiers.math import boxed_contents, extract_answer


def _sample(gold: str, **params) -> Sample:
    return Sample(
        data_source="toy",
        prompt=[{"role": "user", "content": "q"}],
        images=[],
        ability="math",
        reward_model=RewardSpec(
            ground_truth=gold, verifier="math", verifier_params=params, accuracy_ratio=1.0, format_ratio=0.0
        ),
        extra_info={"id": "t"},
    )


def _accuracy(gold: str, response: str, **params) -> float:
    result = get_verifier("math")(response, _sample(gold, **params))
    assert result.error is None, result.error
    return result.components["accuracy"]


@pytest.mark.parametrize("gold", ["3", "4"])
def test_hedging_over_several_boxes_is_wrong(gold):
    # Before: the last box was read, so "3 or 4" earned reward whenever the gold was 4.
    assert _accuracy(gold, "It is \\boxed{3} or maybe \\boxed{4}") == 0.0
    assert _accuracy(gold, "\\boxed{3} \\fbox{4}") == 0.0
    assert _accuracy(gold, "<answer>\\boxed{3}</answer> \\boxed{4}") == 0.0


def test_several_boxes_are_right_when_the_gold_is_the_set_they_form():
    # V-Triune (math-verify, boxed="all") reads all boxes as one set: right for a set/list gold.
    assert _accuracy("3, 4", "\\boxed{3} and \\boxed{4}") == 1.0
    assert _accuracy("\\{3, 4\\}", "\\boxed{4} and \\boxed{3}") == 1.0
    assert extract_answer("\\boxed{3} and \\boxed{4}") == "3, 4"


def test_repeating_one_answer_is_not_hedging():
    assert _accuracy("3", "first \\boxed{3}, so finally \\boxed{ 3 }") == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "<answer>5}</answer>",
        "\\boxed{5}}",
        "<answer>5} \\text{ or } {6</answer>",  # read as \boxed{5} + junk before the fix
        "so \\boxed{5} and then {",
    ],
)
def test_unbalanced_braces_in_the_answer_are_not_credited(response):
    result = get_verifier("math")(response, _sample("5"))
    assert result.components["accuracy"] == 0.0
    assert result.components["malformed"] == 1.0


def test_balanced_and_escaped_braces_still_count():
    assert _accuracy("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}") == 1.0
    assert _accuracy("5", "<answer>{5}</answer>") == 1.0
    assert _accuracy("\\{1\\}", "\\boxed{\\{1\\}}") == 1.0


def test_a_number_hidden_in_a_text_group_is_not_credited():
    # math-verify drops \text{...} as a unit, so "3 (or 4)" read as 3 before the fix.
    assert _accuracy("3", "\\boxed{3\\text{ (or 4)}}") == 0.0
    assert _accuracy("3", "\\boxed{3\\mbox{, else 4}}") == 0.0
    # a unit without digits is still a unit
    assert _accuracy("5", "\\boxed{5\\text{ cm}}") == 1.0


@pytest.mark.parametrize(
    "response", ["\\boxed{3, 4}", "\\boxed{\\pm 3}", "\\boxed{3 \\text{ or } 4}", "<answer>3 or 4</answer>"]
)
def test_hedges_inside_one_answer_are_wrong(response):
    assert _accuracy("3", response) == 0.0


def test_a_flood_of_different_boxes_is_not_parsed():
    result = get_verifier("math")(" ".join(f"\\boxed{{{i}}}" for i in range(100)), _sample("3"))
    assert result.components["accuracy"] == 0.0 and result.components["malformed"] == 1.0


def test_boxed_contents_is_linear_on_hostile_input():
    text = "\\boxed{" * 20000 + "x"
    assert boxed_contents(text) == []
    assert boxed_contents("\\boxed{a} \\boxed{\\frac{1}{2}} \\fbox {c}") == ["a", "\\frac{1}{2}", "c"]


# V-Triune's accuracy (`style: vtriune`, what /judge uses for `mathverify`), as its server
# computes it: lower-cased texts, LaTeX extraction over the whole response, boxes first.
@pytest.mark.parametrize(
    ("gold", "response", "accuracy"),
    [
        ("3", "\\boxed{3}", 1.0),
        ("3", "<answer>3</answer>", 0.0),  # no LaTeX anchor: V-Triune extracts nothing
        ("3", "<answer>$3$</answer>", 1.0),
        ("3", "\\boxed{3} or \\boxed{4}", 0.0),  # boxed="all": the set {3, 4}
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("5", "\\boxed{5}}", 0.0),  # V-Triune credits this (1.0); mmrl's brace guard does not
    ],
)
def test_vtriune_style_accuracy(gold, response, accuracy):
    assert _accuracy(gold, response, style="vtriune") == accuracy


def test_vtriune_style_unparseable_gold_is_an_error_not_a_zero():
    result = get_verifier("math")("\\boxed{3}", _sample("\\{", style="vtriune"))
    assert result.error is not None
