"""benchmarks/megabench_agreement.py's case generator (runs without MEGA-Bench's checkout)."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "megabench_agreement.py"


@pytest.fixture(scope="module")
def agreement():
    spec = importlib.util.spec_from_file_location("megabench_agreement", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_are_fixed_by_the_seed(agreement):
    first = agreement.generate_cases(scale=0.05)
    assert pickle.dumps(first) == pickle.dumps(agreement.generate_cases(scale=0.05))
    assert pickle.dumps(first) != pickle.dumps(agreement.generate_cases(seed=1, scale=0.05))


def test_every_reproduced_metric_and_parser_is_covered(agreement):
    import mmrl.eval.task_metrics  # noqa: F401 - registers the task scorers
    from mmrl.eval.megabench import REFERENCE_METRICS

    cases = agreement.generate_cases(scale=0.05)
    metrics = {c["name"] for c in cases if c["kind"] == "metric"}
    expected = set(REFERENCE_METRICS) - set(agreement.JUDGES) - set(agreement.ALIASES)
    assert metrics == expected
    assert {c["name"] for c in cases if c["kind"] == "parser"} == set(agreement.PARSERS)
    assert {c["name"] for c in cases if c["kind"] == "query"} == {"query/json", "query/answer_string"}
    edge = {c["name"] for c in cases if c["origin"] == "edge" and c["kind"] == "metric"}
    assert expected - edge <= {"symbolic_planning_test"}  # hand-picked cases for all but planning


def test_scores_compare_as_megabench_defines_them(agreement):
    assert agreement.same_score(float("nan"), -1.0)  # mmrl's -1 stands for MEGA-Bench's NaN
    assert agreement.same_score(1, 1.0) and agreement.same_score(True, 1.0)
    assert not agreement.same_score(0.5, 0.5 + 1e-6)
    assert agreement.same_value({1: "x"}, {1: "x"}) and not agreement.same_value({1: "x"}, {"1": "x"})
    assert not agreement.same_value([1], [1.0]) and not agreement.same_value(True, 1)
