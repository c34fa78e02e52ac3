"""The ocr, choice, number and counting verifiers: hand-worked specifications."""

from __future__ import annotations

from typing import Any

import pytest

from mmrl.types import RewardSpec, Sample
from mmrl.verifiers import get_verifier, verifier_names
from mmrl.verifiers.math import extract_answer
from mmrl.verifiers.registry import SampleFieldError
from mmrl.verifiers.text import (
    MAX_OCR_CHARS,
    edit_similarity,
    extract_choice,
    final_answer,
    levenshtein,
    normalize_text,
    parse_count,
    parse_number,
)

OPTIONS = ["Paris", "London", "Rome", "Berlin"]


def _sample(
    verifier: str,
    gold: Any,
    params: dict[str, Any] | None = None,
    acc_ratio: float = 1.0,
    fmt_ratio: float = 0.0,
) -> Sample:
    return Sample(
        data_source="toy",
        prompt=[{"role": "user", "content": "q"}],
        images=[],
        ability=verifier,
        reward_model=RewardSpec(
            ground_truth=gold,
            verifier=verifier,
            verifier_params=params or {},
            accuracy_ratio=acc_ratio,
            format_ratio=fmt_ratio,
        ),
        extra_info={"id": "t"},
    )


def _score(verifier: str, gold: Any, response: str, params: dict[str, Any] | None = None):
    sample = _sample(verifier, gold, params)
    get_verifier(verifier).check_sample(sample)
    result = get_verifier(verifier)(response, sample)
    assert result.error is None
    return result


def _field_error(verifier: str, gold: Any, params: dict[str, Any] | None = None) -> str:
    with pytest.raises(SampleFieldError) as info:
        get_verifier(verifier).check_sample(_sample(verifier, gold, params))
    return info.value.field


def test_all_four_are_registered():
    for name in ("ocr", "choice", "number", "counting"):
        assert name in verifier_names()
        assert get_verifier(name).name == name


# --------------------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    "text",
    [
        "so \\boxed{3}.",
        "\\boxed{1} then \\boxed{\\frac{1}{2}}",
        "<think>hm</think><answer>42</answer>",
        "<answer>x \\boxed{7}</answer>",
        "<answer>a</answer> <answer> b </answer> <answer>c",
        "\\boxed{3} </answer> \\boxed{",
        "no answer here",
    ],
)
def test_final_answer_is_the_shared_rule(text):
    assert final_answer(text) == extract_answer(text)


def test_final_answer_is_linear_on_unclosed_answer_tags():
    # The plain lazy tag regex is quadratic here (125,000 starts, each scanning to the end).
    assert final_answer("</answer>" + "<answer>" * 125_000) is None


# --------------------------------------------------------------------------- ocr helpers


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("sitting", "kitten", 3),
        ("flaw", "lawn", 2),  # -f, +n
        ("", "abc", 3),
        ("abc", "", 3),
        ("", "", 0),
        ("same", "same", 0),
        ("abc", "xyz", 3),
        ("intention", "execution", 5),
    ],
)
def test_levenshtein_by_hand(a, b, distance):
    assert levenshtein(a, b) == distance


def test_edit_similarity_by_hand():
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_similarity("flaw", "lawn") == pytest.approx(0.5)
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("stop", "stop") == 1.0


@pytest.mark.parametrize(
    ("steps", "text", "expected"),
    [
        (["lower"], "  Hello World ", "hello world"),
        (["strip_punctuation"], "Hello, world! (x)", "Hello world x"),
        (["strip_punctuation"], "$5 + 3", "$5 + 3"),  # symbols are not punctuation
        (["collapse_whitespace"], "a \t b\n\nc", "a b c"),
        (["remove_whitespace"], "a \t b\n\nc", "abc"),
        (["nfkc"], "ＡＢＣ １２ ﬁ", "ABC 12 fi"),
        ([], "  As Is  ", "As Is"),
        (["nfkc", "lower", "collapse_whitespace"], "ＳＴＯＰ  Sign", "stop sign"),
    ],
)
def test_normalisation_steps(steps, text, expected):
    assert normalize_text(text, steps) == expected


def test_default_normalisation_and_unknown_step():
    assert normalize_text(" Ｈｅｌｌｏ   World ") == "hello world"
    with pytest.raises(ValueError):
        normalize_text("x", ["upper"])


# --------------------------------------------------------------------------- ocr verifier


@pytest.mark.parametrize(
    ("response", "exact", "similarity"),
    [
        ("\\boxed{STOP}", 1.0, 1.0),
        ("<answer>  stop </answer>", 1.0, 1.0),
        ("STOP", 1.0, 1.0),  # bare answer: the whole response
        ("\\boxed{\\text{Stop}}", 1.0, 1.0),
        ("\\boxed{STOR}", 0.0, 0.75),  # one substitution in four
        ("\\boxed{ST}", 0.0, 0.5),  # two deletions in four
        ("\\boxed{YIELD}", 0.0, 0.0),  # 5 edits, max len 5
    ],
)
def test_ocr_exact_match_and_edit_similarity(response, exact, similarity):
    result = _score("ocr", "Stop", response)
    assert result.components["exact_match"] == exact
    assert result.components["edit_similarity"] == pytest.approx(similarity)
    assert result.components["accuracy"] == pytest.approx(similarity)


def test_ocr_metric_exact_match_and_normalize_param():
    params = {"metric": "exact_match", "normalize": ["lower", "strip_punctuation", "remove_whitespace"]}
    assert _score("ocr", "Hello, World!", "\\boxed{hello world}", params).components["accuracy"] == 1.0
    # Default normalisation keeps punctuation: 2 deletions ("," and "!") over 13 characters.
    result = _score("ocr", "Hello, World!", "\\boxed{hello world}")
    assert result.components["exact_match"] == 0.0
    assert result.components["accuracy"] == pytest.approx(11 / 13)
    # No normalisation: case matters.
    result = _score("ocr", "ABC", "\\boxed{abc}", {"normalize": [], "metric": "exact_match"})
    assert result.components["accuracy"] == 0.0


def test_ocr_empty_response_has_no_answer():
    result = _score("ocr", "Stop", "   ")
    assert result.components == {"accuracy": 0.0, "format": 0.0, "exact_match": 0.0, "edit_similarity": 0.0}
    assert result.extracted is None and result.error is None


def test_ocr_check_sample_errors_name_the_field():
    assert _field_error("ocr", 42) == "reward_model.ground_truth"
    assert _field_error("ocr", "x", {"normalise": ["lower"]}) == "reward_model.verifier_params.normalise"
    assert _field_error("ocr", "x", {"normalize": ["upper"]}) == "reward_model.verifier_params.normalize"
    assert _field_error("ocr", "x", {"normalize": "lower"}) == "reward_model.verifier_params.normalize"
    assert _field_error("ocr", "x", {"metric": "bleu"}) == "reward_model.verifier_params.metric"
    assert _field_error("ocr", "x", {"format": "xml"}) == "reward_model.verifier_params.format"
    get_verifier("ocr").check_sample(_sample("ocr", "", {"format": "think_answer", "metric": "exact_match"}))


def test_ocr_long_prediction_is_truncated():
    gold = "a" * 10
    result = _score("ocr", gold, "\\boxed{" + "a" * 1_000_000 + "}")
    # Compared on the first MAX_OCR_CHARS characters: 10 shared, the rest inserted.
    assert result.components["edit_similarity"] == pytest.approx(10 / MAX_OCR_CHARS)
    assert result.components["exact_match"] == 0.0


# --------------------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("text", "letters"),
    [
        ("B", "B"),
        ("b", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("[B]", "B"),
        ("**B**", "B"),
        ("\\text{B}", "B"),
        ("b) London", "B"),
        ("B. London", "B"),
        ("B: London", "B"),
        ("(B) London", "B"),
        ("B because it is the capital", "B"),
        ("Answer: B", "B"),
        ("The answer is B", "B"),
        ("The answer is (C).", "C"),
        ("Thinking... so the answer is: option D.", "D"),
        ("london", "B"),  # option text, case-insensitive
        ("Rome.", "C"),
        ("A, C", "AC"),
        ("C, A", "AC"),
        ("AC", "AC"),
        ("A and C", "AC"),
        ("(A) (C)", "AC"),
        ("A & C", "AC"),
        ("Paris and Rome", "AC"),
        ("E", None),  # out of range (4 options)
        ("a cat", None),  # lower-case letter then a space is prose
        ("Madrid", None),
        ("", None),
        ("ac", None),  # lower-case runs are words, not letter sets
    ],
)
def test_extract_choice(text, letters):
    assert extract_choice(text, OPTIONS) == letters


def test_extract_choice_without_options_allows_a_to_z():
    assert extract_choice("E") == "E"
    assert extract_choice("Paris") is None
    assert extract_choice("The answer is G.") == "G"


@pytest.mark.parametrize(
    ("gold", "response", "accuracy", "fmt"),
    [
        ("B", "\\boxed{B}", 1.0, 1.0),
        ("b", "<answer>(B)</answer>", 1.0, 1.0),
        ("B", "B", 1.0, 1.0),  # bare
        ("B", "The answer is B.", 1.0, 1.0),
        ("B", "\\boxed{London}", 1.0, 1.0),
        ("B", "\\boxed{C}", 0.0, 1.0),
        ("B", "\\boxed{B and C}", 0.0, 1.0),  # a hedge is not a hit
        ("B", "\\boxed{Madrid}", 0.0, 0.0),  # no letter: no answer
        ("B", "\\boxed{E}", 0.0, 0.0),
        (["A", "C"], "\\boxed{A, C}", 1.0, 1.0),
        (["c", "a"], "\\boxed{CA}", 1.0, 1.0),
        (["A", "C"], "\\boxed{Paris and Rome}", 1.0, 1.0),
        (["A", "C"], "\\boxed{A}", 0.0, 1.0),  # subset
        (["A", "C"], "\\boxed{A, B, C}", 0.0, 1.0),  # superset
    ],
)
def test_choice_verifier(gold, response, accuracy, fmt):
    result = _score("choice", gold, response, {"options": OPTIONS})
    assert result.components == {"accuracy": accuracy, "format": fmt}


def test_choice_check_sample_errors_name_the_field():
    opts = {"options": OPTIONS}
    assert _field_error("choice", "E", opts) == "reward_model.ground_truth"  # out of range
    assert _field_error("choice", ["A", "F"], opts) == "reward_model.ground_truth"
    assert _field_error("choice", "AB", opts) == "reward_model.ground_truth"
    assert _field_error("choice", [], opts) == "reward_model.ground_truth"
    assert _field_error("choice", 2, opts) == "reward_model.ground_truth"
    assert _field_error("choice", "1") == "reward_model.ground_truth"
    assert _field_error("choice", "A", {"options": "Paris"}) == "reward_model.verifier_params.options"
    assert _field_error("choice", "A", {"options": ["x", "X"]}) == "reward_model.verifier_params.options"
    assert _field_error("choice", "A", {"options": ["x", ""]}) == "reward_model.verifier_params.options"
    assert _field_error("choice", "A", {"choices": OPTIONS}) == "reward_model.verifier_params.choices"
    get_verifier("choice").check_sample(_sample("choice", "Z"))  # no options: A..Z
    get_verifier("choice").check_sample(_sample("choice", ["a", "d"], opts))


# --------------------------------------------------------------------------- number


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("1,234.5 cm", 1234.5),
        ("$12", 12.0),
        ("45%", 45.0),
        ("45 percent", 45.0),
        ("-3.5", -3.5),
        ("x = -5", -5.0),
        ("\u22127", -7.0),  # Unicode minus
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{1}{8} m", 0.125),
        ("1.5e-3", 0.0015),
        ("2E3", 2000.0),
        ("1.2 \\times 10^{3}", 1200.0),
        ("10^{-2}", 0.01),
        ("5 cm^{2}", 5.0),  # a unit's exponent is not the answer
        ("1{,}234", 1234.0),
        ("1\\,000", 1000.0),
        ("50\\%", 50.0),
        ("between 3 and 5", 5.0),  # the last number
        ("pages 3-5", 5.0),  # a hyphen between numbers is not a sign
        (".5", 0.5),
        ("It is 7.", 7.0),
        ("no number", None),
        ("", None),
        ("1/0", None),
        ("1e999", None),  # not finite
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == (None if value is None else pytest.approx(value))


def test_parse_number_percent_as_fraction():
    assert parse_number("45%", "fraction") == pytest.approx(0.45)
    assert parse_number("45", "fraction") == 45.0


@pytest.mark.parametrize(
    ("gold", "response", "params", "accuracy"),
    [
        ("1234.5", "\\boxed{1,234.5 cm}", {}, 1.0),
        (100, "\\boxed{101}", {}, 1.0),  # 1% of 100 = 1: on the edge
        (100, "\\boxed{101.5}", {}, 0.0),
        (100, "\\boxed{99}", {}, 1.0),
        (0.3, "\\boxed{0.303}", {}, 1.0),  # edge, despite float rounding
        (100, "\\boxed{105}", {"rel_tol": 0.05}, 1.0),
        (100, "\\boxed{101}", {"rel_tol": 0.0}, 0.0),
        (0, "\\boxed{0.001}", {}, 0.0),  # rel_tol of 0 is 0
        (0, "\\boxed{0.001}", {"abs_tol": 0.01}, 1.0),
        ("45%", "\\boxed{0.45}", {"percent": "fraction"}, 1.0),
        ("45%", "\\boxed{45\\%}", {}, 1.0),
        ("0.45", "\\boxed{45%}", {}, 0.0),  # as_is: 45 != 0.45
        ("0.75", "<answer>3/4</answer>", {}, 1.0),
        ("0.75", "\\boxed{\\frac{3}{4}}", {}, 1.0),
        ("\\boxed{12}", "\\boxed{$12}", {}, 1.0),  # a boxed ground truth is unwrapped
    ],
)
def test_number_verifier(gold, response, params, accuracy):
    assert _score("number", gold, response, params).components["accuracy"] == accuracy


def test_number_components():
    result = _score("number", 200, "\\boxed{210}")
    assert result.components == {"accuracy": 0.0, "format": 1.0, "relative_error": pytest.approx(0.05)}
    assert result.extracted == "210"
    # No number: accuracy 0, no relative error; a bare response is not read.
    for response in ("\\boxed{unsure}", "210", ""):
        result = _score("number", 200, response)
        assert result.components == {"accuracy": 0.0, "format": 0.0}
    capped = _score("number", 0, "\\boxed{5}", {"abs_tol": 1.0})
    assert capped.components["relative_error"] == 1e6


def test_number_check_sample_errors_name_the_field():
    assert _field_error("number", "n/a") == "reward_model.ground_truth"
    assert _field_error("number", float("inf")) == "reward_model.ground_truth"
    assert _field_error("number", True) == "reward_model.ground_truth"
    assert _field_error("number", None) == "reward_model.ground_truth"
    assert _field_error("number", 1, {"rel_tol": -0.1}) == "reward_model.verifier_params.rel_tol"
    assert _field_error("number", 1, {"rel_tol": "1%"}) == "reward_model.verifier_params.rel_tol"
    assert _field_error("number", 1, {"abs_tol": float("nan")}) == "reward_model.verifier_params.abs_tol"
    assert _field_error("number", 1, {"percent": "ratio"}) == "reward_model.verifier_params.percent"
    assert _field_error("number", 1, {"tolerance": 0.1}) == "reward_model.verifier_params.tolerance"


# --------------------------------------------------------------------------- counting


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("3", 3),
        ("There are 7 cats", 7),
        ("three", 3),
        ("Twenty", 20),
        ("zero", 0),
        ("1,024", 1024),
        ("5.0", 5),
        ("5.", 5),
        ("first 2, then 4", 4),
        ("4 apples, one of them red", 4),  # digits win over words
        ("2.5", None),  # not a count
        ("-3", None),
        ("twenty-one", None),  # only zero..twenty, and not hyphenated
        ("someone", None),
        ("none", None),
    ],
)
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize(
    ("gold", "response", "params", "accuracy"),
    [
        (3, "\\boxed{3}", {}, 1.0),
        ("3", "\\boxed{three}", {}, 1.0),
        (3, "<answer>There are 3 red shapes.</answer>", {}, 1.0),
        (3, "\\boxed{4}", {}, 0.0),
        (4, "\\boxed{3}", {"partial": True}, 0.75),  # 1 - 1/4
        (4, "\\boxed{6}", {"partial": True}, 0.5),
        (4, "\\boxed{10}", {"partial": True}, 0.0),  # clipped at 0
        (0, "\\boxed{0}", {"partial": True}, 1.0),
        (0, "\\boxed{1}", {"partial": True}, 0.0),  # divides by max(gold, 1)
    ],
)
def test_counting_verifier(gold, response, params, accuracy):
    assert _score("counting", gold, response, params).components["accuracy"] == pytest.approx(accuracy)


def test_counting_components():
    result = _score("counting", 5, "\\boxed{8}")
    assert result.components == {"accuracy": 0.0, "format": 1.0, "abs_error": 3.0}
    for response in ("\\boxed{many}", "8", "\\boxed{2.5}"):
        assert _score("counting", 5, response).components == {"accuracy": 0.0, "format": 0.0}


def test_counting_check_sample_errors_name_the_field():
    assert _field_error("counting", -1) == "reward_model.ground_truth"
    assert _field_error("counting", 2.0) == "reward_model.ground_truth"
    assert _field_error("counting", "three") == "reward_model.ground_truth"
    assert _field_error("counting", True) == "reward_model.ground_truth"
    assert _field_error("counting", 3, {"partial": "yes"}) == "reward_model.verifier_params.partial"
    assert _field_error("counting", 3, {"exact": True}) == "reward_model.verifier_params.exact"
    get_verifier("counting").check_sample(_sample("counting", " 12 ", {"partial": True}))


# --------------------------------------------------------------------------- mixing


@pytest.mark.parametrize(
    ("verifier", "gold", "params", "right", "wrong"),
    [
        ("ocr", "stop", {"metric": "exact_match"}, "\\boxed{STOP}", "\\boxed{go}"),
        ("choice", "B", {}, "\\boxed{B}", "\\boxed{A}"),
        ("number", 12, {}, "\\boxed{12}", "\\boxed{20}"),
        ("counting", 3, {}, "\\boxed{3}", "\\boxed{4}"),
    ],
)
def test_score_mixes_accuracy_and_format_with_the_samples_ratios(verifier, gold, params, right, wrong):
    sample = _sample(verifier, gold, params, acc_ratio=0.8, fmt_ratio=0.2)
    scorer = get_verifier(verifier)
    assert scorer(right, sample).score == pytest.approx(1.0)
    assert scorer(wrong, sample).score == pytest.approx(0.2)
    think = _sample(verifier, gold, {**params, "format": "think_answer"}, acc_ratio=1.0, fmt_ratio=0.5)
    full = "<think>\nhm\n</think>\n<answer>\n" + right + "\n</answer>"
    assert scorer(full, think).score == pytest.approx(1.5)
    assert scorer(right, think).score == pytest.approx(1.0)  # right, but no tags: format 0


# --------------------------------------------------------------------------- huge inputs

HUGE = 1_000_000
HUGE_RESPONSES = [
    "a" * HUGE,
    "9" * HUGE,
    "\\boxed{" + "9" * HUGE + "}",
    "\\boxed{" + "A, " * (HUGE // 3) + "}",
    "</answer>" + "<answer>" * (HUGE // 8),
    "\\boxed{" * (HUGE // 7),
    "(" * HUGE,
    " " * HUGE,
    "answer is " * (HUGE // 10),
    "<answer>" + "1," * (HUGE // 2) + "</answer>",
]


@pytest.mark.parametrize("verifier", ["ocr", "choice", "number", "counting"])
def test_huge_responses_are_scored_without_error(verifier):
    # Promptly, and without a verifier error; number and counting refuse a huge *answer* by
    # its size cap instead (`answer_too_long` etc.: an error of its own kind, by design).
    from mmrl.verifiers.limits import answer_limit_kind

    gold = {"ocr": "stop", "choice": "A", "number": 3, "counting": 3}[verifier]
    sample = _sample(verifier, gold)
    scorer = get_verifier(verifier)
    for response in HUGE_RESPONSES:
        # time_limit_s=0: no timer, so a stall would hang here rather than become an error.
        result = scorer(response, sample, time_limit_s=0)
        if verifier in ("number", "counting") and answer_limit_kind(result.error) is not None:
            assert result.score == 0.0
            continue
        assert result.error is None
        assert 0.0 <= result.components["accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------------
# Issue 36, defect 8: hedging in the number and counting verifiers. Before, the last number was
# graded, so "3 or 4" scored 1.0 for gold 4; the module promises hedging is never right by luck.


@pytest.mark.parametrize("verifier", ["number", "counting"])
@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{3} or \\boxed{4}",
        "<answer>3 or 4</answer>",
        "\\boxed{4} or maybe \\boxed{3}",
        "<answer>4, 3</answer>",
        "<answer>3-4</answer>",
    ],
)
def test_two_different_final_answers_are_malformed(verifier, response):
    result = get_verifier(verifier)(response, _sample(verifier, 4, fmt_ratio=0.5))
    assert result.error is None
    assert result.score == 0.0
    assert result.components["accuracy"] == 0.0 and result.components["format"] == 0.0
    assert result.components["malformed"] == 1.0


def test_counting_words_hedge_too_but_digits_decide_when_present():
    assert (
        get_verifier("counting")("<answer>three or four</answer>", _sample("counting", 4)).components[
            "malformed"
        ]
        == 1.0
    )
    # "4 apples, one of them red": digits win over words, as documented: not a hedge.
    result = get_verifier("counting")("<answer>4 apples, one of them red</answer>", _sample("counting", 4))
    assert result.components == {"accuracy": 1.0, "format": 1.0, "abs_error": 0.0}


@pytest.mark.parametrize(
    ("verifier", "response", "gold"),
    [
        ("number", "\\boxed{4} and again \\boxed{4}", 4),  # one answer repeated
        ("number", "\\boxed{4.0}", 4),
        ("number", "<answer>1,234.5 cm</answer>", 1234.5),
        ("number", "\\boxed{1.2\\times10^{3}}", 1200),
        ("number", "\\boxed{\\frac{3}{4}}", 0.75),
        ("number", "\\boxed{45\\%}", 45),
        ("counting", "\\boxed{1,024}", 1024),
        ("counting", "<answer>There are 5 cars.</answer>", 5),
        ("counting", "\\boxed{5} \\boxed{5.0}", 5),
    ],
)
def test_one_number_written_in_one_of_its_forms_is_not_a_hedge(verifier, response, gold):
    result = get_verifier(verifier)(response, _sample(verifier, gold))
    assert result.error is None and "malformed" not in result.components
    assert result.components["accuracy"] == 1.0


def test_number_and_counting_refuse_a_capped_answer_before_reading_it():
    from mmrl.types import AnswerLimits, VerifyContext
    from mmrl.verifiers.limits import answer_limit_kind

    listed = "<answer>" + ", ".join(str(i) for i in range(20_000)) + "</answer>"  # 20k listed numbers
    for verifier in ("number", "counting"):
        result = get_verifier(verifier)(listed, _sample(verifier, 4))
        assert answer_limit_kind(result.error) == "answer_too_long" and result.score == 0.0
        tight = VerifyContext(limits=AnswerLimits(max_depth=1))
        result = get_verifier(verifier)("\\boxed{((4))}", _sample(verifier, 4), tight)
        assert answer_limit_kind(result.error) == "answer_too_deep"
