"""`--scoring megabench` reproduces MEGA-Bench's own scoring (megabench/metrics/ in
TIGER-AI-Lab/MEGA-Bench), quirks included; `--scoring corrected` keeps mmrl's fixes.

Each case states what MEGA-Bench's code does with the input (read from its source, and checked
against that code run on the same inputs) and what the corrected mode gives.
"""

from __future__ import annotations

import json

import pytest

from mmrl.eval import megabench as mb
from mmrl.eval import metrics
from mmrl.eval.metrics import FieldContext


def reference(name, response, target, **ctx) -> float:
    return mb.score_reference(name, response, target, FieldContext(**ctx))[0]


def corrected(name, response, target) -> float:
    return metrics.score_field(name, response, target)


CASES = [
    # (metric, response, reference, MEGA-Bench, corrected, what MEGA-Bench does)
    # -- a one-letter target against an option text
    ("exact_str_match", "Because", "B", 1.0, 0.0, "a one-letter target takes the response's first letter"),
    ("exact_str_match", "(B) blue", "B", 1.0, 1.0, "an option letter with its text"),
    ("simple_str_match", "because", "b", 1.0, 0.0, "normalised first, then the same first-letter rule"),
    # -- BLEU
    ("bleu", "the cat sat on the mat", "the cat", 0.0, 0.1623, "the reference is scored as the hypothesis"),
    (
        "bleu",
        "the cat",
        "the cat sat on the mat",
        0.1623,
        0.1353,
        "swapped: brevity penalty on the reference",
    ),
    ("bleu", "a b", "a b", 0.0, 1.0, "4-grams always: two identical tokens score 0 (no shorter orders)"),
    ("bleu", "x y z w", "a b c d", 0.0, 0.0799, "nothing matches: 0, no smoothing"),
    (
        "bleu",
        ["a dog", "the cat"],
        ["the cat", "a dog"],
        0.0,
        0.4518,
        "lists are zipped sentence by sentence",
    ),
    # -- list / set reading
    ("set_equality", "{'a': 1, 'b': 2}", "['a', 'b']", 1.0, 0.0, "a dict written as text gives its keys"),
    ("set_equality", {"a": 1}, "['a']", 0.0, 0.0, "a dict value gives its (key, value) items"),
    ("set_equality", "None", "[]", 0.0, 1.0, "'None' reads as the empty string, not as an empty set"),
    ("set_equality", "None", "None", 1.0, 1.0, "two 'None's are the same empty string"),
    ("set_equality", "[[1, 2], [3]]", "[]", 1.0, 0.0, "nested lists are unhashable: the empty set"),
    ("set_equality", "'abc'", "['a', 'b', 'c']", 1.0, 0.0, "a quoted string gives its characters"),
    ("chess_move_list_jaccard_index", "Nf3+, e4", "Nf3, e4", 1 / 3, 1.0, "only ! and # are dropped, not +"),
    # -- None as text
    ("exact_str_match", None, "None", 1.0, 0.0, "a missing field is compared as the text 'None'"),
    ("exact_str_match", None, "N", 1.0, 0.0, "... and its first letter is N"),
    # -- errors score 0
    ("longest_common_list_prefix_ratio", "[]", "[]", 0.0, 1.0, "an empty reference divides by zero: 0"),
    ("sequence_accuracy_case_insensitive", "[]", "[]", 0.0, 1.0, "empty sequences divide by zero: 0"),
    ("dict_jaccard_agg_jaccard", {}, {}, 0.0, 1.0, "no key at all divides by zero: 0"),
    (
        "sequence_accuracy_case_insensitive",
        "[1, 2]",
        "['a', 'b']",
        0.0,
        0.0,
        "a number response has no .lower(): 0",
    ),
    # -- numbers
    ("number_rel_diff_ratio", True, "1", 1.0, 0.0, "a boolean is a number (True = 1)"),
    ("number_rel_diff_ratio", "0", "0", 0.0, 1.0, "a zero target divides by zero: 0 even for an exact 0"),
    ("positive_int_match", 3, "3", 0.0, 1.0, "an int (a JSON value) is no literal to read: 0"),
    ("positive_int_match", "3", "3", 1.0, 1.0, "the same number as text matches"),
    ("general_single_numerical_match", "3\\pi", "9.42", 1.0, 1.0, "pi becomes 3.14 before reading"),
    (
        "general_single_numerical_match",
        "True",
        "1",
        0.0,
        0.0,
        "SymPy reads True as the product T*r*u*e: text",
    ),
    (
        "general_single_numerical_match",
        "(1, 2)",
        "(1, 2)",
        0.0,
        1.0,
        "tuples never match (only lists are compared)",
    ),
    ("general_single_numerical_match", "[2, 1]", "[1, 2]", 1.0, 1.0, "lists compared sorted"),
    ("general_single_numerical_match", "0.001", "0", 0.0, 0.0, "a zero target needs an exact 0 (1% of 0)"),
    ("boxed_single_numerical_match", "\\boxed{3} then \\boxed{4}", "4", 0.0, 1.0, "the first box is read"),
]


@pytest.mark.parametrize(
    ("name", "response", "target", "megabench", "fixed", "why"), CASES, ids=[c[5] for c in CASES]
)
def test_megabench_scoring_and_the_corrected_mode(name, response, target, megabench, fixed, why):
    assert reference(name, response, target) == pytest.approx(megabench, abs=1e-4), why
    assert corrected(name, response, target) == pytest.approx(fixed, abs=1e-4)


def test_an_error_is_kept_beside_its_zero():
    score, error = mb.score_reference("number_rel_diff_ratio", "0", "0", FieldContext())
    assert score == 0.0 and "ZeroDivisionError" in error
    # an empty box sequence is NaN in MEGA-Bench, which aggregation leaves out: -1 here
    assert mb.score_reference("nbbox_iou_sequence", "[]", "[]", FieldContext()) == (-1.0, None)


# -- parsers


@pytest.mark.parametrize(
    ("response", "parsed", "why"),
    [
        ("**Answer:** B", "", "the bold pattern ends at the ** right after the colon: empty"),
        ("**Answer: B**", "B", "bold around the whole answer"),
        ("ANSWER: B", "ANSWER: B", "only Answer:/answer: are markers: the whole text"),
        ("answer: a\nAnswer: C", "C", "the last marker wins"),
        ("Answer: B\n\nBecause it is blue", "B", "a short first paragraph is the answer"),
        ("Answer: 'B'", "B", "quotes are dropped"),
        ("Answer: {'b': 1}", "{'b': 1}", "a dict is passed on as its Python text"),
    ],
)
def test_answer_string_parser(response, parsed, why):
    assert mb.parse_answer_string(response) == parsed, why


def test_answer_string_parser_corrected_reads_bold_answers():
    from mmrl.eval.parsers import parse_answer_string

    assert parse_answer_string("**Answer:** B", "A").fields["A"] == "B"
    assert parse_answer_string("ANSWER: B", "A").fields["A"] == "B"


def test_json_parser_reads_only_the_answer_line():
    # MEGA-Bench: from the first line starting with "Answer:", one line of text (after any
    # blank space): a JSON object spread over lines is cut, and what follows is not read.
    assert mb.parse_json('Answer: {"a": 1,\n "b": 2}') == {}
    assert mb.parse_json('Answer: {"a": 1}\n{"b": 2}') == {"a": 1}
    assert mb.parse_json('Answer:\n{"a": 1}') == {"a": 1}
    from mmrl.eval.parsers import parse_json_value

    assert parse_json_value('Answer: {"a": 1,\n "b": 2}') == {"a": 1, "b": 2}  # corrected: reads past


def test_json_parser_inlines_json_held_in_strings_and_keeps_key_types():
    assert mb.parse_json('{"a": "{\\"b\\": 1}"}') == {"a": {"b": 1}}
    assert mb.parse_json("Answer: {1: 'x', 2: 'y'}") == {1: "x", 2: "y"}  # integer keys stay
    fields, ok, _ = mb.parse_fields("Answer: {1: 'x'}", "json", {"1": "x"}, ["1"])
    assert ok and fields.get("1") is None  # ... so the field "1" is not found
    fields, ok, _ = mb.parse_fields("no json here", "json", {"a": "x", "b": "y"}, ["a", "b"])
    assert not ok and fields == {"a": "no json here", "b": "no json here"}  # raw text per field


def test_a_json_span_megabench_cannot_read_scores_the_dict_metric_zero():
    # MEGA-Bench's parse_json catches only SyntaxError/ValueError around ast.literal_eval, so
    # `{[1, 2]}` (a set holding a list) raises TypeError out of cast_to_dict and its metric
    # wrapper scores the whole field 0 (not 1/2 for the key that matches); found by
    # benchmarks/megabench_agreement.py.
    target = '{"a": "x", "b": [[1, 2]]}'
    assert reference("dict_set_equality_agg_jaccard", {"a": "x", "b": "{[1, 2]}"}, target) == 0.0
    assert reference("dict_exact_str_match_agg_recall", {"a": "x", "b": "{[1]}"}, {"a": "x", "b": "y"}) == 0.0
    assert reference("dict_exact_str_match_agg_recall", {"a": "x", "b": "[1]"}, {"a": "x", "b": "y"}) == 0.5
    # in a response parser the same error crashes MEGA-Bench's evaluator; mmrl skips the span
    assert mb.parse_answer_string("Answer: {[1, 2]}") == "{[1, 2]}"
    assert mb.parse_fields("Answer: {[1, 2]}", "json", {"a": "1"}, ["a"])[1] is False


def test_a_complex_answer_gets_no_credit_from_the_rmse_metrics():
    # MEGA-Bench gives normalized_rmse("1j", "0") the complex score (1-10j) and
    # angle_seq_float_rmse([1j, 2], [1, 2]) (0.95+0.05j), on which its aggregation raises
    # (`s >= 0`): no reference number. Taking the real part would score the imaginary answer 1.0
    # and 0.95; mmrl scores 0 (deliberate, listed in mmrl/eval/megabench.py).
    assert reference("normalized_rmse", "1j", "0") == 0.0
    assert reference("angle_seq_float_rmse", "[1j, 2]", "[1, 2]") == 0.0
    assert reference("normalized_rmse", "0.01", "0") == pytest.approx(0.9)  # real answers as before
    assert reference("angle_seq_float_rmse", "[1.5, 2]", "[1, 2]") == pytest.approx(0.975)


# -- aggregation


def test_aggregation_needs_every_weight_and_a_positive_total():
    assert mb.aggregate_query({"a": 1.0, "b": 0.0}, {"a": 3, "b": 1}) == 0.75
    assert mb.aggregate_query({"a": -1.0}, {"a": 1}) == -1.0  # no field counts
    assert mb.aggregate_query({"a": 1.0, "b": -1.0}, {"a": 1}) == 1.0  # a -1 field needs no weight
    with pytest.raises(KeyError):  # MEGA-Bench: weights[field] raises
        mb.aggregate_query({"a": 1.0, "b": 0.5}, {"a": 1})
    with pytest.raises(ZeroDivisionError):  # MEGA-Bench: np.average with zero total weight raises
        mb.aggregate_query({"a": 1.0}, {"a": 0})
    from mmrl.eval.aggregate import aggregate_query

    assert aggregate_query({"a": 1.0, "b": 0.5}, {"a": 1}) == 0.75  # corrected: a missing weight is 1
    assert aggregate_query({"a": 1.0}, {"a": 0}) == -1.0  # corrected: nothing counts
    assert "no weight for ['b']" in mb.check_task(
        "t", {"a": "exact_str_match", "b": "exact_str_match"}, {"a": 1}, "mean"
    )
    assert "sum to 0" in mb.check_task("t", {"a": "exact_str_match"}, {"a": 0}, "mean")
    assert mb.check_task("t", {"a": "exact_str_match"}, {}, "min") is None


# -- the runner says which scoring produced a number


def _suite(folder, weights=None):
    folder.mkdir(parents=True, exist_ok=True)
    task = {
        "task_name": "letters",
        "task_description": "Pick a letter.",
        "query_response": [
            {"query_idx": 0, "query_text": "q0", "correct_answer": {"Answer": "B"}},
            {"query_idx": 1, "query_text": "q1", "correct_answer": {"Answer": "C"}},
        ],
        "metric_info": {
            "field_score_function": {"Answer": "exact_str_match"},
            "aggregation": {
                "function": "mean",
                "field_weights": {"Answer": 1} if weights is None else weights,
            },
            "response_parse_function": "answer_string",
        },
    }
    (folder / "letters.json").write_text(json.dumps(task))
    return folder


class _Engine:
    """Answers 'Because ...' to every query (right under MEGA-Bench's letter rule for B)."""

    def generate(self, samples, params):
        from types import SimpleNamespace

        return SimpleNamespace(texts=["Answer: Because it is so"] * len(samples))


def test_runner_scores_with_megabench_by_default_and_says_so(tmp_path):
    from mmrl.eval.config import EvalConfig
    from mmrl.eval.runner import results_markdown, run_suite

    suite = _suite(tmp_path / "suite")
    default = run_suite(_Engine(), suite, EvalConfig(progress=False))
    assert default.summary["scoring"] == "megabench" and default.summary["overall"] == 0.5
    assert "Scoring: `megabench`" in results_markdown(default)
    fixed = run_suite(_Engine(), suite, EvalConfig(progress=False, scoring="corrected"))
    assert fixed.summary["scoring"] == "corrected" and fixed.summary["overall"] == 0.0
    assert "not comparable" in results_markdown(fixed)


def test_runner_refuses_a_task_megabench_would_crash_on(tmp_path):
    from mmrl.eval.config import EvalConfig
    from mmrl.eval.runner import run_suite
    from mmrl.eval.suite import SuiteError

    suite = _suite(tmp_path / "suite", weights={})
    with pytest.raises(SuiteError, match="no weight for \\['Answer'\\]"):
        run_suite(_Engine(), suite, EvalConfig(progress=False))
    assert (
        run_suite(_Engine(), suite, EvalConfig(progress=False, scoring="corrected")).summary["overall"] == 0.0
    )


def test_cli_has_the_scoring_flag():
    import argparse

    from mmrl.eval.command import add_eval_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert config_from_args(parser.parse_args([])).scoring == "megabench"
    assert config_from_args(parser.parse_args(["--scoring", "corrected"])).scoring == "corrected"


def test_a_metric_whose_package_is_missing_skips_its_queries(tmp_path, monkeypatch):
    from mmrl.eval.config import EvalConfig
    from mmrl.eval.runner import run_suite

    # `import rapidfuzz.distance` fails (the submodule too: an earlier test may have imported it)
    monkeypatch.setitem(__import__("sys").modules, "rapidfuzz", None)
    monkeypatch.setitem(__import__("sys").modules, "rapidfuzz.distance", None)
    folder = _suite(tmp_path / "suite")
    task = json.loads((folder / "letters.json").read_text())
    task["metric_info"]["field_score_function"] = {"Answer": "normalized_similarity_damerau_levenshtein"}
    (folder / "letters.json").write_text(json.dumps(task))
    result = run_suite(_Engine(), folder, EvalConfig(progress=False))
    (letters,) = result.tasks
    assert letters.score is None and letters.skipped == {"unavailable_metric": 2}
    assert "rapidfuzz" in result.skipped_queries[0]["error"]
