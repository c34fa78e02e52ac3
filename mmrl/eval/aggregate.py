"""From field scores to a suite score, as MEGA-Bench aggregates them.

- query: the weighted mean (or the min) of its fields scoring >= 0; -1 when no field counts
  (e.g. every field is a `positive_int_match` with both sides <= 0);
- task: the mean over its scored queries, a -1 query counting as 0;
- Core: the macro mean over rule-scored tasks; Open: over judge-scored tasks; overall: the mean
  over all tasks (the task-weighted mean of Core and Open);
- breakdowns: the mean task score per keyword of each metadata dimension (skills, input format,
  output format, application, number of inputs), with the number of tasks behind it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KEYWORD_DIMENSIONS = ("skills", "input_format", "output_format", "app", "num_input")
"""Task metadata dimensions that breakdowns are computed over (MEGA-Bench's names)."""


def aggregate_query(
    scores: Mapping[str, float], weights: Mapping[str, float], function: str = "mean"
) -> float:
    """One query's score from its field scores; fields scoring < 0 do not count; -1 if none does.

    `mean` weights each counted field by `weights[field]` (1 when absent); zero-weight fields do
    not count. `min` takes the lowest counted score.
    """
    counted = {f: s for f, s in scores.items() if s >= 0}
    if function == "min":
        return min(counted.values()) if counted else -1.0
    if function != "mean":
        raise ValueError(f"unknown aggregation {function!r} (known: mean, min)")
    total = sum(float(weights.get(f, 1.0)) for f in counted)
    if total <= 0:
        return -1.0
    return sum(s * float(weights.get(f, 1.0)) for f, s in counted.items()) / total


def task_score(query_scores: Iterable[float]) -> float | None:
    """Mean over the task's scored queries, -1 counting as 0; None when none was scored."""
    scores = [max(float(s), 0.0) for s in query_scores]
    return sum(scores) / len(scores) if scores else None


@dataclass
class TaskResult:
    """One task's outcome."""

    name: str
    eval_type: str
    """`core` (rule-scored) or `open` (judge-scored)."""
    score: float | None
    """Mean query score, or None when no query was scored."""
    num_queries: int
    """Queries selected for evaluation."""
    num_scored: int
    """Queries that were answered and scored."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> number of queries skipped for it."""
    parse_failures: int = 0
    """Scored queries whose response could not be parsed (the raw text was scored)."""
    field_errors: int = 0
    """Field scores that raised (scored 0, the error kept in the query record)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Keywords (skills, input_format, ...) for breakdowns."""
    agent: dict[str, float] | None = None
    """Turn and tool figures of its scored queries when they ran with tools
    (`mmrl.rollout.multiturn.trajectory_summary`), else None."""


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(tasks: list[TaskResult]) -> dict[str, Any]:
    """Core / Open / overall macro means, micro means and counts over the tasks that were scored."""
    scored = [t for t in tasks if t.score is not None]
    core = [t.score for t in scored if t.eval_type == "core"]
    open_ = [t.score for t in scored if t.eval_type == "open"]
    all_scores = [t.score for t in scored]
    queries = sum(t.num_scored for t in scored)
    micro = sum(t.score * t.num_scored for t in scored) / queries if queries else None
    skipped: dict[str, int] = defaultdict(int)
    for t in tasks:
        for reason, n in t.skipped.items():
            skipped[reason] += n
    return {
        "overall": _mean(all_scores),
        "core": _mean(core),
        "open": _mean(open_),
        "micro": micro,
        "num_tasks": {"core": len(core), "open": len(open_), "unscored": len(tasks) - len(scored)},
        "num_queries": queries,
        "skipped": dict(skipped),
        "parse_failures": sum(t.parse_failures for t in tasks),
        "field_errors": sum(t.field_errors for t in tasks),
    }


def keyword_breakdown(tasks: list[TaskResult]) -> dict[str, dict[str, dict[str, float]]]:
    """Per dimension, per keyword: the mean score of the tasks carrying it and their count."""
    out: dict[str, dict[str, list[float]]] = {d: defaultdict(list) for d in KEYWORD_DIMENSIONS}
    for t in tasks:
        if t.score is None:
            continue
        for dim in KEYWORD_DIMENSIONS:
            value = t.metadata.get(dim)
            keywords = value if isinstance(value, (list, tuple)) else [value] if value else []
            for kw in keywords:
                out[dim][str(kw)].append(t.score)
    return {
        dim: {kw: {"score": sum(s) / len(s), "num_tasks": len(s)} for kw, s in sorted(kws.items())}
        for dim, kws in out.items()
        if kws
    }
