"""Aggregation: query (weighted mean / min, -1 fields), task, Core / Open / overall, keywords."""

from __future__ import annotations

import pytest

from mmrl.eval.aggregate import TaskResult, aggregate_query, keyword_breakdown, summarize, task_score


def test_query_score_is_the_weighted_mean_of_the_fields_that_count():
    # (1 * 1 + 0.5 * 3) / (1 + 3)
    assert aggregate_query({"a": 1.0, "b": 0.5}, {"a": 1, "b": 3}) == pytest.approx(2.5 / 4)
    # A -1 field (positive_int_match with both <= 0) is left out of the mean.
    assert aggregate_query({"a": 1.0, "b": -1.0}, {"a": 1, "b": 3}) == pytest.approx(1.0)
    # No field counts: the query is -1.
    assert aggregate_query({"a": -1.0, "b": -1.0}, {"a": 1, "b": 1}) == -1
    # Missing weights count 1; zero-weight fields alone count as nothing.
    assert aggregate_query({"a": 1.0, "b": 0.0}, {}) == pytest.approx(0.5)
    assert aggregate_query({"a": 1.0}, {"a": 0}) == -1


def test_min_aggregation_ignores_minus_one_fields():
    assert aggregate_query({"a": 0.2, "b": 0.9, "c": -1.0}, {}, "min") == pytest.approx(0.2)
    assert aggregate_query({"c": -1.0}, {}, "min") == -1
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate_query({"a": 1.0}, {}, "median")


def test_task_score_counts_minus_one_queries_as_zero():
    assert task_score([1.0, 0.5, -1.0]) == pytest.approx(1.5 / 3)
    assert task_score([]) is None


def _t(name, kind, score, n, **meta):
    return TaskResult(name=name, eval_type=kind, score=score, num_queries=n, num_scored=n, metadata=meta)


def test_core_open_and_overall_are_macro_means_over_tasks():
    tasks = [
        _t("a", "core", 1.0, 10, skills=["Counting", "OCR"], app="Perception"),
        _t("b", "core", 0.5, 30, skills=["Counting"], app="Perception"),
        _t("c", "open", 0.2, 5, skills=["OCR"], app="Coding"),
        TaskResult(
            name="d", eval_type="core", score=None, num_queries=3, num_scored=0, skipped={"missing_media": 3}
        ),
    ]
    s = summarize(tasks)
    assert s["core"] == pytest.approx(0.75)
    assert s["open"] == pytest.approx(0.2)
    assert s["overall"] == pytest.approx((1.0 + 0.5 + 0.2) / 3)  # the task-weighted mean of Core and Open
    assert s["micro"] == pytest.approx((10 * 1.0 + 30 * 0.5 + 5 * 0.2) / 45)
    assert s["num_tasks"] == {"core": 2, "open": 1, "unscored": 1}
    assert s["skipped"] == {"missing_media": 3}
    kw = keyword_breakdown(tasks)
    assert kw["skills"]["Counting"] == {"score": pytest.approx(0.75), "num_tasks": 2}
    assert kw["skills"]["OCR"] == {"score": pytest.approx(0.6), "num_tasks": 2}
    assert kw["app"]["Coding"]["score"] == pytest.approx(0.2)
    assert "input_format" not in kw  # no task carries it
