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


# ---------------------------------------------------------------------------------------------
# Issue 36, defect 7: expensive answers are refused by size caps before math-verify parses them.

EXPENSIVE = {
    # The cases ran math-verify into its 5 s time-out before the caps: a 40k-character
    # sum, 3,000-deep braces and 20k listed numbers (the last two are past the length cap
    # first). Each cap gets a case under the others: braces 14 deep are 29 characters, and ran
    # past 10 s (measured, issue 36); 450 one-digit numbers listed are 899 characters and tokens.
    "answer_too_long": "\\boxed{" + "+".join(["1"] * 20_000) + "}",
    "answer_too_deep": "\\boxed{" + "{" * 14 + "5" + "}" * 14 + "}",
    "answer_too_many_tokens": "\\boxed{" + ",".join(["7"] * 450) + "}",
}


@pytest.fixture
def no_parsing(monkeypatch):
    """math-verify's parse made to fail the test: an answer refused by a cap never reaches it."""
    import mmrl.verifiers.math as math_module

    def refuse(*args, **kwargs):
        raise AssertionError("math-verify was asked to parse a capped answer")

    monkeypatch.setattr(math_module, "_parse", refuse)
    monkeypatch.setattr(math_module, "_parse_response_vtriune", refuse)


@pytest.mark.parametrize("kind", sorted(EXPENSIVE))
@pytest.mark.parametrize("style", ["mmrl", "vtriune"])
def test_an_expensive_answer_is_refused_before_parsing_with_its_own_error_kind(kind, style, no_parsing):
    from mmrl.verifiers.limits import answer_limit_kind

    params = {"style": style} if style == "vtriune" else {}
    result = get_verifier("math")(EXPENSIVE[kind], _sample("5", **params))
    assert result.score == 0.0
    assert answer_limit_kind(result.error) == kind, result.error


def test_the_caps_are_configurable_and_zero_switches_one_off(monkeypatch):
    from mmrl.types import AnswerLimits, VerifyContext

    response = "\\boxed{" + "+".join(["1"] * 5) + "}"  # 1+1+1+1+1 = 5: 9 characters, 9 tokens
    sample = _sample("5")
    tight = VerifyContext(limits=AnswerLimits(max_chars=8))
    assert get_verifier("math")(response, sample, tight).error.startswith("answer_too_long: the answer has 9")
    tight = VerifyContext(limits=AnswerLimits(max_tokens=8))
    assert get_verifier("math")(response, sample, tight).error.startswith("answer_too_many_tokens")
    deep = "\\boxed{((5))}"
    tight = VerifyContext(limits=AnswerLimits(max_depth=1))
    assert get_verifier("math")(deep, sample, tight).error.startswith(
        "answer_too_deep: brackets nested 2 deep"
    )
    off = VerifyContext(limits=AnswerLimits(max_chars=0, max_depth=0, max_tokens=0))
    result = get_verifier("math")(response, sample, off)
    assert result.error is None and result.components["accuracy"] == 1.0
    # The defaults let an ordinary answer through.
    ordinary = "\\boxed{\\frac{\\sqrt{x^{2}+1}}{2\\left(x-\\frac{1}{3}\\right)}}"
    assert get_verifier("math")(ordinary, _sample("\\frac{\\sqrt{x^{2}+1}}{2(x-1/3)}")).error is None


def test_the_cap_measures():
    from mmrl.verifiers.limits import count_tokens, nesting_depth

    assert nesting_depth("\\frac{a}{(b+[c])}") == 3
    assert nesting_depth("}}{(") == 2  # a closer without an opener is ignored
    # x _ { 12 } ^ { 2 } + \alpha: numbers, words, commands and other characters count one each.
    assert count_tokens("x_{12}^{2}+\\alpha") == 11
    assert count_tokens("1 " * 100, stop_after=10) == 11


def test_the_router_and_the_server_apply_their_configured_caps():
    from mmrl.router import Router
    from mmrl.server.protocol import WireItem
    from mmrl.server.scoring import WireScorer
    from mmrl.types import AnswerLimits, VerifyContext

    limits = AnswerLimits(max_chars=3)
    with Router(num_workers=0, answer_limits=limits) as router:
        batch = router.score([_sample("12345")], ["\\boxed{12345}"], VerifyContext())
    assert batch.results[0].error.startswith("answer_too_long")
    fields = ("math", "12345", {}, 1.0, 0.0, "toy", "t", None)
    item: WireItem = (fields, "\\boxed{12345}", 0, 1, False)
    result = WireScorer(5.0, 16, limits)(item, {})
    assert result[2].startswith("answer_too_long") and result[0] == 0.0
    assert WireScorer(5.0, 16)(item, {})[2] is None  # the default caps let it through


def test_refused_answers_are_counted_by_kind():
    import torch

    from mmrl.router import RewardBatch
    from mmrl.server.metrics import Metrics
    from mmrl.train.step_metrics import step_metrics
    from mmrl.types import RolloutBatch, VerifierResult

    errors = ["answer_too_long: x", "answer_too_deep: y", "answer_too_long: z", "ValueError: w"]
    results = [VerifierResult(0.0, error=e) for e in errors]
    samples = [_sample("5")] * 4
    rewards = RewardBatch.of(results, samples)
    batch = RolloutBatch(
        samples=samples,
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_ids=torch.zeros(4, 2, dtype=torch.long),
        response_mask=torch.ones(4, 2, dtype=torch.long),
        rollout_logprobs=torch.zeros(4, 2),
        vision_inputs={},
        texts=[""] * 4,
        truncated=torch.zeros(4, dtype=torch.bool),
        group_size=2,
    )
    metrics = step_metrics(batch, rewards, torch.zeros(4), 2)
    assert metrics["verifier/rejected_answers"] == 3.0
    assert metrics["verifier/rejected_answers/answer_too_long"] == 2.0
    assert metrics["verifier/rejected_answers/answer_too_deep"] == 1.0
    assert metrics["verifier/errors"] == 4.0  # still verifier errors, like the time-outs they were
    server = Metrics()
    item = (("math", "5", {}, 1.0, 0.0, "toy", "t", None), "r", 0, 1, False)
    server.results_done([item] * 4, [(0.0, {}, e, None, None) for e in errors])
    assert server.errors[("math", "answer_too_long")] == 2
    assert server.errors[("math", "answer_too_deep")] == 1
    assert server.errors[("math", "error")] == 1


def test_a_refused_answer_scores_zero_and_stays_even_when_errors_are_dropped():
    """A babbling policy must not escape its penalty through `reward.on_error=drop`: a refused
    answer is a verdict on the response (scored 0, kept in its group), a time-out is not."""
    import torch

    from mmrl.config import load_config
    from mmrl.router import RewardBatch
    from mmrl.train.grpo import StepInputs
    from mmrl.types import RolloutBatch, VerifierResult

    cfg = load_config(
        "vision_reasoning", overrides=["reward.on_error=drop", "algo.advantage=grpo", "rollout.group_size=2"]
    )
    results = [
        VerifierResult(1.0),
        VerifierResult(0.0, error="answer_too_long: the answer has 20000 characters (limit 1000)"),
        VerifierResult(0.0, error="timeout: the verifier took longer than 5 s"),
        VerifierResult(1.0),
    ]
    samples = [_sample("5")] * 4
    batch = RolloutBatch(
        samples=samples,
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_ids=torch.zeros(4, 2, dtype=torch.long),
        response_mask=torch.ones(4, 2, dtype=torch.long),
        rollout_logprobs=torch.zeros(4, 2),
        vision_inputs={},
        texts=[""] * 4,
        truncated=torch.zeros(4, dtype=torch.bool),
        group_size=2,
    )
    inputs = StepInputs.empty(4, old=torch.zeros(4, 2), ref=None, tis=False)
    inputs.fill(cfg, batch, range(4), RewardBatch.of(results, samples))
    assert inputs.dropped.tolist() == [False, False, True, False]
    # Group 0 (1 vs the refused 0): the refusal is pushed down, its partner up (GRPO: +-1/std).
    assert inputs.advantages[0] > 0 > inputs.advantages[1]
    assert batch.response_mask[1].tolist() == [1, 1] and batch.response_mask[2].tolist() == [0, 0]
