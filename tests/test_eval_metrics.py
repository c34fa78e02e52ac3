"""Field metrics by MEGA-Bench name, each against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from mmrl.eval import metrics as M
from mmrl.eval.metrics import FieldContext, get_metric, score_field


def s(name: str, response, reference, ctx: FieldContext | None = None) -> float:
    return score_field(name, response, reference, ctx)


# --------------------------------------------------------------------------- registry


def test_every_mega_bench_metric_family_is_registered_by_its_name():
    names = {
        "exact_str_match", "simple_str_match", "exact_str_match_case_insensitive", "code_result_exact_str_match",
        "normalized_similarity_damerau_levenshtein", "near_str_match", "number_rel_diff_ratio",
        "general_single_numerical_match", "general_numerical_match", "boxed_single_numerical_match",
        "set_equality", "set_equality_case_insensitive", "set_precision", "jaccard_index",
        "jaccard_index_case_insensitive", "str_set_equality_line_break", "str_set_equality_comma",
        "sequence_equality", "sequence_equality_case_insensitive", "sequence_accuracy_case_insensitive",
        "longest_common_list_prefix_ratio", "nbbox_iou_single", "nbbox_iou_tuple", "nbbox_iou_sequence",
        "xml_norm_point_distance", "xml_norm_point_in_bbox", "xml_nbbox_iou_single", "normalized_rmse",
        "angle_seq_float_rmse", "positive_int_match", "multi_ref_phrase", "dict_equality", "dict_precision",
        "dict_exact_str_match_agg_recall", "dict_set_equality_agg_jaccard", "dict_jaccard_agg_jaccard",
        "dict_nbbox_iou_tuple_agg_jaccard", "bleu", "gleu", "gleu_cn", "latex_expr_equality",
        "text_with_latex_expr_equality", "chess_move_list_jaccard_index", "sequence_coords_similarity",
        "gpt_4o_as_judge", "ascii_art_gpt4o_judge", "model_judge",
    }  # fmt: skip
    assert names <= set(M.metric_names())
    assert not set(M.UNSUPPORTED) & set(M.metric_names())
    assert M.is_judge_metric("gpt_4o_as_judge") and not M.is_judge_metric("exact_str_match")


def test_unknown_metric_names_suggest_the_closest():
    with pytest.raises(KeyError, match="did you mean 'exact_str_match'"):
        get_metric("exact_str_mach")


# --------------------------------------------------------------------------- strings


def test_exact_match_and_the_single_letter_option_quirk():
    assert s("exact_str_match", "Paris", "Paris") == 1
    assert s("exact_str_match", "paris", "Paris") == 0
    # A single-letter reference matches the option letter however it is written...
    for response in ("B", "(B)", "B.", "B. the dog", "(B) the dog", "B) dog", "B: dog", "B dog"):
        assert s("exact_str_match", response, "B") == 1, response
    # ...but not a word that merely starts with it, nor the option's text alone.
    assert s("exact_str_match", "Because it is brown", "B") == 0
    assert s("exact_str_match", "the dog", "B") == 0
    assert s("exact_str_match", "(C) the dog", "B") == 0
    # Numbers from the JSON parser compare as their text.
    assert s("exact_str_match", 3, "3") == 1
    assert s("code_result_exact_str_match", "42", "```\n42\n```") == 1


def test_case_insensitive_and_simple_string_match():
    assert s("exact_str_match_case_insensitive", "PARIS", "paris") == 1
    assert s("exact_str_match_case_insensitive", "(b) dog", "B") == 1
    # simple: spaces, hyphens, dots, tabs, newlines removed, case folded.
    assert s("simple_str_match", "New-York City.", "new york city") == 1
    assert s("simple_str_match", "New York", "Newark") == 0


def test_damerau_levenshtein_similarity():
    # Unrestricted Damerau-Levenshtein: "ca" -> "abc" is 2 (optimal string alignment says 3).
    assert M.damerau_levenshtein("ca", "abc") == 2
    assert M.damerau_levenshtein("kitten", "sitting") == 3
    assert s("normalized_similarity_damerau_levenshtein", "abdc", "abcd") == pytest.approx(0.75)
    assert s("normalized_similarity_damerau_levenshtein", "ca", "abc") == pytest.approx(1 / 3)
    assert s("normalized_similarity_damerau_levenshtein", "", "") == 1
    assert s("normalized_similarity_damerau_levenshtein", ["a"], "a") == 0  # not a string


def test_near_string_match_folds_accents_articles_and_case_with_a_cut_off():
    assert s("near_str_match", "The Café", "cafe") == 1
    # One deletion in 13 characters: 12/13 = 0.923 >= 0.9.
    assert s("near_str_match", "encyclopaedia", "encyclopedia") == pytest.approx(12 / 13)
    # One edit in 5 characters: 0.8 < 0.9, so 0.
    assert s("near_str_match", "cafes", "cafe") == 0


def test_multi_reference_phrase():
    assert s("multi_ref_phrase", "new york", "['NYC', 'New York']") == 1
    assert s("multi_ref_phrase", "Boston", "NYC, New York") == 0
    assert s("multi_ref_phrase", "北京", "上海，北京") == 1  # a Chinese comma separates too


# --------------------------------------------------------------------------- numbers


def test_number_relative_difference_ratio():
    assert s("number_rel_diff_ratio", "90", "100") == pytest.approx(0.9)
    assert s("number_rel_diff_ratio", "150", "100") == pytest.approx(0.5)
    assert s("number_rel_diff_ratio", "300", "100") == 0
    assert s("number_rel_diff_ratio", "about 90", "100") == 0
    assert s("number_rel_diff_ratio", "0", "0") == 1


def test_positive_int_match_and_its_minus_one():
    assert s("positive_int_match", "3", "3") == 1
    assert s("positive_int_match", "2", "3") == 0
    assert s("positive_int_match", 3, "3") == 1
    # Both <= 0: the field does not count.
    assert s("positive_int_match", "0", "0") == -1
    assert s("positive_int_match", "-1", "0") == -1
    assert s("positive_int_match", "0", "3") == 0
    assert s("positive_int_match", "3.0", "3") == 0  # not an integer
    assert s("positive_int_match", "three", "3") == 0


def test_normalized_rmse_and_angle_sequences():
    assert s("normalized_rmse", "0.55", "0.5") == pytest.approx(0.5)  # 1 - 0.05 / 0.1
    assert s("normalized_rmse", "0.8", "0.5") == 0
    # Mean absolute difference (0 + 6) / 2 = 3 degrees -> 1 - 3/10.
    assert s("angle_seq_float_rmse", "[10, 20]", "[10, 26]") == pytest.approx(0.7)
    assert s("angle_seq_float_rmse", "[10]", "[10, 26]") == 0


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("\\frac{1}{2}", "0.5", 1),
        ("$\\frac{1}{2}$", "0.5", 1),
        ("100.9", "100", 1),  # within 1%
        ("101.5", "100", 0),
        ("5 cm", "5", 1),  # units
        ("x = 12", "12", 1),  # the value after '='
        ("50%", "0.5", 1),
        ("1,000", "1000", 1),  # thousands separator
        ("2\\sqrt{4}", "4", 1),
        ("(2, 1)", "(1, 2)", 1),  # sequences compared sorted
        ("(2, 3)", "(1, 2)", 0),
        ("0", "0", 1),
        ("yes", "Yes", 1),  # not numeric: simple string match
        ("3 + x", "3", 0),
    ],
)
def test_general_numerical_match(response, reference, expected):
    assert s("general_single_numerical_match", response, reference) == expected


def test_boxed_numerical_match_reads_the_last_box():
    assert s("boxed_single_numerical_match", "so \\boxed{\\frac{3}{4}}", "0.75") == 1
    assert s("boxed_single_numerical_match", "\\boxed{1} no, \\boxed{2}", "2") == 1
    assert s("boxed_single_numerical_match", "\\boxed{3}", "\\boxed{4}") == 0


def test_latex_expression_equality():
    assert s("latex_expr_equality", "x^2+2x+1", "(x+1)^2") == 1
    assert s("latex_expr_equality", "\\frac{1}{2}", "0.5") == 1
    assert s("latex_expr_equality", "x+1", "x+2") == 0
    assert s("text_with_latex_expr_equality", "The area is $\\frac{1}{2}$", "the area is $0.5$") == 1
    assert s("text_with_latex_expr_equality", "The volume is $\\frac{1}{2}$", "the area is $0.5$") == 0


# --------------------------------------------------------------------------- sets and sequences


def test_set_metrics_including_empty_sets():
    assert s("set_equality", "b, a", "['a', 'b']") == 1
    assert s("set_equality", "a", "a, b") == 0
    assert s("set_equality", "[]", "") == 1  # both empty: equal
    assert s("set_equality_case_insensitive", "A, B", "b, a") == 1
    assert s("str_set_equality_line_break", "x\\ny", "Y\nX") == 1
    assert s("str_set_equality_comma", "A, B", "b, a") == 1
    assert s("jaccard_index", "a, b, c", "b, c, d") == pytest.approx(2 / 4)
    assert s("jaccard_index", "", "") == 1  # both empty
    assert s("jaccard_index", "", "a") == 0
    assert s("jaccard_index", None, "a") == 0  # no response
    assert s("jaccard_index_case_insensitive", "A, b", "a, B, c") == pytest.approx(2 / 3)
    assert s("set_precision", "a, x", "a, b, c") == pytest.approx(1 / 2)
    assert s("set_precision", "[]", "a, b") == 1  # an empty prediction: MEGA-Bench's 1
    assert s("set_precision", None, "a, b") == 0
    # A bracket opened and never closed reads as the empty set.
    assert M.to_set("[a, b") == set()
    assert s("chess_move_list_jaccard_index", "Qh5+, Nf3", "Nf3, Qh5#") == 1


def test_sequence_metrics():
    assert s("sequence_equality", "[1, 2, 3]", "[1, 2, 3]") == 1
    assert s("sequence_equality", "[1, 3, 2]", "[1, 2, 3]") == 0
    assert s("sequence_equality", [1, 2, 3], "[1, 2, 3]") == 1  # a JSON list as is
    assert s("sequence_equality_case_insensitive", "A, b", "['a', 'B']") == 1
    assert s("sequence_accuracy_case_insensitive", "a, X, c", "['A', 'b', 'C']") == pytest.approx(2 / 3)
    assert s("sequence_accuracy_case_insensitive", "a, b", "['A', 'b', 'C']") == 0  # lengths differ
    assert s("longest_common_list_prefix_ratio", "[1, 2, 9, 4]", "[1, 2, 3, 4]") == pytest.approx(0.5)
    assert s("longest_common_list_prefix_ratio", "[9]", "[1, 2]") == 0


# --------------------------------------------------------------------------- boxes and points


def test_box_iou_metrics():
    assert M.box_iou([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(1 / 7)  # 1 / (4 + 4 - 1)
    assert M.box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0
    # Each prediction's best IoU, averaged over predictions: (1/7 + 0) / 2.
    assert s("nbbox_iou_tuple", "[[0, 0, 2, 2], [10, 10, 11, 11]]", "[[1, 1, 3, 3]]") == pytest.approx(1 / 14)
    assert s("nbbox_iou_tuple", "[0, 0, 2, 2]", "[[0, 0, 2, 2]]") == 1  # one bare box
    assert s("nbbox_iou_tuple", "[[0, 0, 2, 2], [1, 2]]", "[[0, 0, 2, 2]]") == 1  # malformed box dropped
    assert s("nbbox_iou_tuple", "no boxes", "[[0, 0, 2, 2]]") == 0
    assert s("nbbox_iou_single", "[0, 0, 2, 2]", "[1, 1, 3, 3]") == pytest.approx(1 / 7)
    assert s("nbbox_iou_single", "[0, 0, 2]", "[1, 1, 3, 3]") == 0
    # Box i against box i: (1 + 1/4) / 2.
    seq = s("nbbox_iou_sequence", "[[0, 0, 2, 2], [0, 0, 1, 1]]", "[[0, 0, 2, 2], [0, 0, 2, 2]]")
    assert seq == pytest.approx(0.625)
    assert s("nbbox_iou_sequence", "[[0, 0, 2, 2]]", "[[0, 0, 2, 2], [0, 0, 2, 2]]") == 0


def test_xml_points_and_boxes():
    assert s("xml_norm_point_distance", "<point>0.3, 0.4</point>", "<point>0, 0</point>") == pytest.approx(
        0.5
    )
    assert (
        s("xml_norm_point_distance", "<point>0.3, 0.4</point><point>0, 0</point>", "<point>0, 0</point>") == 0
    )
    assert s("xml_norm_point_distance", "<point>3, 4</point>", "<point>0, 0</point>") == 0  # not normalised
    ctx = FieldContext(eval_context={"bounding_boxes": ["[0.4, 0.4, 0.6, 0.6]", "[0, 0, 0.1, 0.1]"]})
    assert s("xml_norm_point_in_bbox", "<point>0.5, 0.5</point>", "", ctx) == 1
    assert s("xml_norm_point_in_bbox", "<point>0.6, 0.4</point>", "", ctx) == 1  # edges count
    assert s("xml_norm_point_in_bbox", "<point>0.7, 0.5</point>", "", ctx) == 0
    box = s("xml_nbbox_iou_single", "<box>0, 0, 0.2, 0.2</box>", "<box>0.1, 0.1, 0.3, 0.3</box>")
    assert box == pytest.approx(0.01 / 0.07)
    coords = s("sequence_coords_similarity", "[[0, 0]]", "[[0.3, 0.4]]")
    assert coords == pytest.approx(math.exp(-10 * 0.5 / math.sqrt(2)))


# --------------------------------------------------------------------------- dicts


def test_dict_metrics():
    assert s("dict_equality", '{"a": 1}', "{'a': 1}") == 1
    assert s("dict_equality", "not a dict", "{'a': 1}") == 0
    assert s("dict_precision", '{"a": "1", "b": "2"}', '{"a": "1", "b": "3"}') == pytest.approx(1 / 2)
    assert s("dict_precision", "{}", '{"a": "1"}') == 0
    assert s("dict_exact_str_match_agg_recall", '{"a": "1"}', '{"a": "1", "b": "2"}') == pytest.approx(1 / 2)
    # Keys a, b, c: a equal sets (1), b and c missing on one side (0, 0).
    agg = s("dict_set_equality_agg_jaccard", '{"a": [1, 2], "c": [1]}', '{"a": [2, 1], "b": [3]}')
    assert agg == pytest.approx(1 / 3)
    assert s("dict_jaccard_agg_jaccard", '{"a": [1, 2]}', '{"a": [2, 3]}') == pytest.approx(1 / 3)
    boxes = s(
        "dict_nbbox_iou_tuple_agg_jaccard", '{"cat": [[0,0,2,2]]}', '{"cat": [[1,1,3,3]], "dog": [[0,0,1,1]]}'
    )
    assert boxes == pytest.approx(1 / 14)


# --------------------------------------------------------------------------- text overlap


def test_bleu_and_gleu():
    assert s("bleu", "the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # p1..p4 = 3/4, 2/3, 1/2, and 0/1 smoothed to 1/2; brevity 1: (1/8)^(1/4).
    assert s("bleu", "a b c d", "a b c e") == pytest.approx(0.125**0.25)
    # Precisions all 1 over the orders present; brevity exp(1 - 6/3).
    assert s("bleu", "the cat sat", "the cat sat on the mat") == pytest.approx(math.exp(-1))
    # GLEU: 1..4-gram matches 3 + 2 + 1 + 0 over max(10, 10).
    assert s("gleu", "a b c d", "a b c e") == pytest.approx(0.6)
    assert s("gleu_cn", "我爱北京", "我爱上海") == pytest.approx(0.3)  # (2 + 1) / 10
    assert M.tokenize_13a("Hello, world! 3.5") == ["Hello", ",", "world", "!", "3.5"]


# --------------------------------------------------------------------------- judge


def test_judge_metric_calls_the_configured_judge():
    calls = []

    def judge(prompt: str, response: str, reference: str) -> float:
        calls.append((prompt, response, reference))
        return 0.7

    ctx = FieldContext(prompt="Describe the image.", answer={"Answer": "a red square"}, judge=judge)
    assert s("gpt_4o_as_judge", "a square", "a red square", ctx) == pytest.approx(0.7)
    assert calls == [("Describe the image.", "a square", "a red square")]
    with pytest.raises(ValueError, match="outside"):
        s("model_judge", "x", "y", FieldContext(judge=lambda p, r, ref: 1.5))
    with pytest.raises(ValueError, match="none is configured"):
        s("model_judge", "x", "y", FieldContext())


def test_edit_distance_is_capped_for_huge_responses():
    huge = "ab" * 100_000
    score = s("normalized_similarity_damerau_levenshtein", huge, "ab" * 10)
    assert 0 <= score <= 1
