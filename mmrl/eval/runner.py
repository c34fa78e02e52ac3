"""Running a suite: greedy responses through the rollout engine, parsed, scored, aggregated.

`mmrl eval --suite PATH --model PATH [--max-queries N] [--output DIR]` writes to the output
folder:

| file | holds |
|---|---|
| `results.json` | summary (overall, Core, Open, micro), per-task scores and counts, keyword breakdowns, skipped queries with reasons |
| `results.md` | the same as Markdown tables |
| `results.png` | a bar chart of task scores (Core and Open coloured apart) |
| `queries.jsonl` | one record per query: response, parsed fields, field scores and errors, query score |
| `run.json` | which model and suite the folder belongs to |
| `pass_at_k.json`, `pass_at_k.png` | with `--pass-k K`: pass@1..K of the model (and `--base`) |

**Resuming.** `queries.jsonl` is the cache: a query whose prompt (text, media, generation
length) is unchanged is not generated again, and if its reference and metrics are unchanged it
is not scored again either (judge calls are the expensive part); records are only appended, so
an interrupted run loses at most the batch in flight. A folder holding another model's results
is refused unless `--overwrite`.

**Skipped queries** (counted per reason, listed in `results.json`, never a crash):
`missing_media` (a media file does not exist), `unreadable_media`, `video_media` (the rollout
engine takes images only), `needs_judge` (an Open task and no judge configured) and
`unsupported_metric` (a MEGA-Bench metric this module does not implement). A task with no
scored query gets no score and is left out of the means.

`evaluate_suite(...)` is the trainer's entry point: the same evaluation in memory, returning
`eval_suite/...` metrics.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config import AgentConfig
from mmrl.eval.aggregate import TaskResult, aggregate_query, keyword_breakdown, summarize, task_score
from mmrl.eval.config import EvalConfig
from mmrl.eval.metrics import FieldContext, Judge, score_field
from mmrl.eval.parsers import parse_response, unquote
from mmrl.eval.suite import Query, Suite, SuiteError, Task, _sha1, load_suite
from mmrl.types import AgentSpec, RewardSpec, Sample, Trajectory

log = logging.getLogger(__name__)

RECORDS_FILE = "queries.jsonl"
"""The per-query cache in an output folder."""
SCORING_MODES = ("megabench", "corrected")
"""`--scoring`: MEGA-Bench's own definitions (comparable to published scores) or mmrl's fixes."""


# --------------------------------------------------------------------------- scoring


def judge_prompt(task: Task, query: Query) -> str:
    """The prompt text shown to a judge (image placeholders written out as `[image]`)."""
    text, _ = task.prompt(query)
    return text.replace("<image>", "[image]").replace("<video>", "[video]")


def score_response(
    task: Task, query: Query, response: str, judge: Judge | None = None, scoring: str = "megabench"
) -> dict[str, Any]:
    """Parse and score one response; a field whose metric raises scores 0 and keeps the error.

    `scoring`: `megabench` reproduces MEGA-Bench's own parsers, metrics and aggregation
    (`mmrl.eval.megabench`), `corrected` uses mmrl's (`mmrl.eval.metrics` / `parsers`). A metric
    that needs a missing package raises `MetricUnavailable` (the caller skips the query)."""
    if scoring == "megabench":
        return _score_megabench(task, query, response, judge)
    if scoring != "corrected":
        raise ValueError(f"unknown scoring {scoring!r} (known: {', '.join(SCORING_MODES)})")
    info = task.metric_info
    parsed = parse_response(response, info.response_parse_function, query.answer, task.answer_fields)
    ctx = FieldContext(
        eval_context=query.eval_context, prompt=judge_prompt(task, query), answer=query.answer, judge=judge
    )
    scores: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name, reference in query.answer.items():
        metric = info.field_score_function.get(name)
        if metric is None:  # an auxiliary `##` field without a metric
            continue
        try:
            scores[name] = score_field(metric, parsed.fields.get(name), unquote(reference), ctx)
        except Exception as exc:  # noqa: BLE001 - any metric failure scores 0 and is recorded
            scores[name] = 0.0
            errors[name] = f"{metric}: {type(exc).__name__}: {exc}"
            log.warning("task %s query %s field %s: %s", task.name, query.idx, name, errors[name])
    return {
        "fields": {
            k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
            for k, v in parsed.fields.items()
        },
        "parse_ok": parsed.parse_ok,
        "field_scores": scores,
        "field_errors": errors,
        "score": aggregate_query(scores, info.field_weights, info.aggregation),
    }


def _not_in_megabench(task: Task) -> list[str]:
    from mmrl.eval.megabench import REFERENCE_METRICS

    metrics = [
        *task.metric_info.field_score_function.values(),
        *(task.metric_info.raw.get("global_aux_metrics") or {}).values(),
    ]
    return sorted({m for m in metrics if m not in REFERENCE_METRICS})


def _score_megabench(task: Task, query: Query, response: str, judge: Judge | None) -> dict[str, Any]:
    from mmrl.eval import megabench

    info = task.metric_info
    fields, parse_ok, whole = megabench.parse_fields(
        response, info.response_parse_function, query.answer, task.answer_fields
    )
    ctx = FieldContext(
        eval_context=query.eval_context,
        prompt=judge_prompt(task, query),
        answer=query.answer,
        judge=judge,
        parsed=whole,
        task_name=task.name,
    )
    scores: dict[str, float] = {}
    errors: dict[str, str] = {}

    def score(name: str, metric: str, value: Any, reference: Any) -> None:
        scores[name], error = megabench.score_reference(metric, value, reference, ctx)
        if error is not None:
            errors[name] = f"{metric}: {error}"

    for name, reference in query.answer.items():
        metric = info.field_score_function.get(name)
        if metric is not None:  # an auxiliary `##` field without a metric is not scored
            score(name, metric, fields.get(name), megabench.evaluate_as_string(reference))
    for name, metric in (info.raw.get("global_aux_metrics") or {}).items():
        score(name, metric, whole, query.answer)
    try:
        query_score = megabench.aggregate_query(scores, info.field_weights, info.aggregation)
    except (KeyError, ZeroDivisionError) as exc:  # MEGA-Bench raises here; this query does not count
        errors["(aggregation)"] = str(exc)
        query_score = -1.0
    return {
        "fields": {
            k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in fields.items()
        },
        "parse_ok": parse_ok,
        "field_scores": scores,
        "field_errors": errors,
        "score": query_score,
    }


# --------------------------------------------------------------------------- engine and samples


def as_engine(model: Any, batch_size: int = 8):
    """A rollout engine from a path, a `Policy`, or an engine (anything with `generate`)."""
    from mmrl.models.loading import Policy, load_inference_policy
    from mmrl.rollout.hf import HFRolloutEngine

    if isinstance(model, (str, Path)):
        model = load_inference_policy(model)
    if isinstance(model, Policy):
        return HFRolloutEngine.from_policy(model, max_batch_rows=max(batch_size, 1))
    if hasattr(model, "generate"):
        return model
    raise TypeError(f"expected a model path, a Policy or a rollout engine, got {type(model).__name__}")


def query_sample(
    task: Task, query: Query, tools: tuple[str, ...] = (), max_turns: int | None = None
) -> Sample:
    """The rollout engine's view of a query (images decoded now; reward fields unused); with
    `tools`, a multi-turn sample that may call them."""
    text, media = task.prompt(query)
    return Sample(
        data_source=f"eval/{task.name}",
        prompt=[{"role": "user", "content": text}],
        images=[m.load() for m in media],
        ability="eval",
        reward_model=RewardSpec(ground_truth="", verifier="math"),
        extra_info={"id": f"{task.name}/{query.idx}"},
        agent=AgentSpec(tools=list(tools), max_turns=max_turns) if tools else None,
    )


TRAJECTORY_FIELDS = ("turns", "tool_calls", "tool_errors", "observation_tokens", "termination")
"""What a query's record keeps of its trajectory when it ran with tools (`rec["agent"]`)."""


def agent_summary(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """`trajectory_summary` of the records that ran with tools, or None if none did."""
    from mmrl.rollout.multiturn import trajectory_summary

    kept = [r["agent"] for r in records if r.get("agent")]
    if not kept:
        return None
    return trajectory_summary([Trajectory(**{k: a[k] for k in TRAJECTORY_FIELDS}) for a in kept])


def media_problem(task: Task, query: Query) -> str | None:
    """Why a query cannot be run (`video_media`, `missing_media`), or None."""
    _, media = task.prompt(query)
    if any(m.is_video for m in media):
        return "video_media"
    if any(m.missing() for m in media):
        return "missing_media"
    return None


def select_queries(
    suite: Suite, max_queries: int | None = None, tasks: tuple[str, ...] | list[str] = ()
) -> list[tuple[Task, list[Query]]]:
    """The tasks asked for (all when empty) and each one's first `max_queries` queries."""
    chosen = [suite.task(name) for name in tasks] if tasks else list(suite.tasks)
    return [(t, t.queries[:max_queries] if max_queries is not None else list(t.queries)) for t in chosen]


# --------------------------------------------------------------------------- the cache


OUTPUT_KEPT = (
    "The queries already finished are kept in the output folder: free space (or choose another --output) "
    "and rerun the same command to continue"
)
"""What a failed write of `mmrl eval`'s outputs leaves, and how to go on."""


class RecordCache:
    """`queries.jsonl` of an output folder: last record per (task, query) wins; append-only."""

    def __init__(self, folder: Path | None):
        self.path = folder / RECORDS_FILE if folder is not None else None
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        if self.path is not None and self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        # A line cut short by an interrupted write: that query is simply redone.
                        log.warning("%s:%d: unreadable record ignored (it will be redone)", self.path, lineno)
                        continue
                    self.records[(rec["task"], int(rec["query_idx"]))] = rec

    def get(self, task: str, idx: int) -> dict[str, Any] | None:
        return self.records.get((task, idx))

    def put(self, record: dict[str, Any]) -> None:
        self.records[(record["task"], record["query_idx"])] = record
        if self.path is not None:
            from mmrl.train.storage import storage_errors

            with (
                storage_errors("write a query's record to", self.path, OUTPUT_KEPT),
                self.path.open("a", encoding="utf-8") as f,
            ):
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- the run


@dataclass
class EvalResult:
    """Everything a run produced."""

    summary: dict[str, Any]
    tasks: list[TaskResult]
    breakdown: dict[str, Any]
    skipped_queries: list[dict[str, Any]] = field(default_factory=list)
    generated: int = 0
    """Queries whose response was generated in this run (0 on a fully resumed run)."""
    rescored: int = 0
    """Queries scored in this run (generated ones included)."""
    seconds: float = 0.0
    output_dir: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "tasks": [asdict(t) for t in self.tasks],
            "breakdown": self.breakdown,
            "skipped_queries": self.skipped_queries,
            "generated": self.generated,
            "rescored": self.rescored,
            "seconds": self.seconds,
        }


def _claim_output(folder: Path, model_id: str, suite_path: str, overwrite: bool) -> None:
    from mmrl.train.storage import storage_errors

    with storage_errors("create the output folder", folder):
        folder.mkdir(parents=True, exist_ok=True)
    run_file = folder / "run.json"
    if run_file.exists() and not overwrite:
        previous = json.loads(run_file.read_text(encoding="utf-8"))
        if previous.get("model") != model_id:
            raise ValueError(
                f"{folder} holds results for model {previous.get('model')!r}, not {model_id!r}: "
                "give another --output, or --overwrite to discard them"
            )
    with storage_errors("write", run_file):
        if overwrite and (folder / RECORDS_FILE).exists():
            (folder / RECORDS_FILE).unlink()
        run_file.write_text(json.dumps({"model": model_id, "suite": suite_path}, indent=1), encoding="utf-8")


def check_scoring(suite: Suite, selected: list[tuple[Task, list[Query]]], scoring: str) -> None:
    """Refuses, before anything runs, a scoring mode that does not exist or (with MEGA-Bench's
    scoring) a task its aggregation would crash on: a clear error naming the task, not -1s."""
    if scoring not in SCORING_MODES:
        raise ValueError(f"unknown scoring {scoring!r} (known: {', '.join(SCORING_MODES)})")
    if scoring != "megabench":
        return
    from mmrl.eval.megabench import check_task

    problems = [
        p
        for task, _ in selected
        if (
            p := check_task(
                task.name,
                task.metric_info.field_score_function,
                task.metric_info.field_weights,
                task.metric_info.aggregation,
            )
        )
    ]
    if problems:
        raise SuiteError(suite.path, None, "; ".join(problems))


def run_suite(
    model: Any,
    suite: Suite | str | Path,
    cfg: EvalConfig | None = None,
    judge: Judge | None = None,
    model_id: str | None = None,
) -> EvalResult:
    """Evaluate `model` (a path, `Policy` or engine) on `suite`; write outputs if `cfg.output_dir`
    (holding its lock: one writer at a time, as a run directory)."""
    if not (cfg and cfg.output_dir):
        return _run_suite(model, suite, cfg, judge, model_id)
    from mmrl.train.rundir import RunDirLock

    with RunDirLock(cfg.output_dir, "mmrl eval", option="--output"):
        return _run_suite(model, suite, cfg, judge, model_id)


def _run_suite(
    model: Any,
    suite: Suite | str | Path,
    cfg: EvalConfig | None,
    judge: Judge | None,
    model_id: str | None,
) -> EvalResult:
    from mmrl.progress import ProgressBar
    from mmrl.rollout.hf import SamplingParams

    cfg = cfg or EvalConfig()
    t0 = time.monotonic()
    if not isinstance(suite, Suite):
        suite = load_suite(suite, cfg.media_root)
    if model_id is None:
        model_id = str(Path(model).resolve()) if isinstance(model, (str, Path)) else type(model).__name__
    folder = Path(cfg.output_dir) if cfg.output_dir else None
    if folder is not None:
        _claim_output(folder, model_id, suite.path, cfg.overwrite)
    cache = RecordCache(folder)
    judge = judge if judge is not None else load_judge(cfg)
    judge_id = cfg.judge or cfg.judge_model or getattr(judge, "__qualname__", type(judge).__name__)

    selected = select_queries(suite, cfg.max_queries, cfg.tasks)
    check_scoring(suite, selected, cfg.scoring)
    skipped: list[dict[str, Any]] = []
    to_generate: list[tuple[Task, Query, str, str]] = []
    to_score: list[tuple[Task, Query, str, str, dict]] = []
    for task, queries in selected:
        task_reason = None
        if task.unsupported_metrics():
            task_reason = "unsupported_metric"
        elif cfg.scoring == "megabench" and _not_in_megabench(task):
            task_reason = (
                "unsupported_metric"  # mmrl-only metrics (e.g. `gleu`) have no MEGA-Bench definition
            )
        elif task.eval_type == "open" and judge is None:
            task_reason = "needs_judge"
        for q in queries:
            if task_reason:
                skipped.append({"task": task.name, "query_idx": q.idx, "reason": task_reason})
                continue
            prompt_key = _sha1([task.fingerprint(q), cfg.max_new_tokens])
            if cfg.tools:  # (without tools the key is what it always was: earlier caches stay valid)
                prompt_key = _sha1([prompt_key, list(cfg.tools), cfg.max_turns, cfg.call_format])
            score_key = _sha1([task.score_fingerprint(q), cfg.scoring])
            if task.eval_type == "open":  # another judge re-scores
                score_key = _sha1([score_key, judge_id])
            rec = cache.get(task.name, q.idx)
            if rec is not None and rec.get("prompt_key") == prompt_key:
                if rec.get("score_key") != score_key:
                    to_score.append((task, q, prompt_key, score_key, rec))
                continue
            problem = media_problem(task, q)
            if problem:
                skipped.append({"task": task.name, "query_idx": q.idx, "reason": problem})
                continue
            to_generate.append((task, q, prompt_key, score_key))

    def record(
        task: Task, q: Query, prompt_key: str, score_key: str, response: str, agent: dict | None = None
    ) -> None:
        from mmrl.eval.megabench import MetricUnavailable

        rec = {"task": task.name, "query_idx": q.idx, "prompt_key": prompt_key, "score_key": score_key}
        rec["response"] = response
        if agent is not None:
            rec["agent"] = agent
        try:
            rec.update(score_response(task, q, response, judge, cfg.scoring))
        except MetricUnavailable as exc:
            skipped.append(
                {"task": task.name, "query_idx": q.idx, "reason": "unavailable_metric", "error": str(exc)}
            )
            return
        cache.put(rec)

    generated = 0
    log.info(
        "eval: %d queries to generate, %d to score again from %s",
        len(to_generate),
        len(to_score),
        RECORDS_FILE,
    )
    engine = as_engine(model, cfg.batch_size) if to_generate else None
    params = SamplingParams(n=1, greedy=True, max_new_tokens=cfg.max_new_tokens)
    # With tools, each turn may use max_new_tokens and the whole trajectory max_turns of them
    # (observations included); the tools' own limits are the training defaults (`agent.*`).
    agent_cfg = AgentConfig(
        max_turns=cfg.max_turns,
        max_tokens=cfg.max_turns * cfg.max_new_tokens + 4096,
        call_format=cfg.call_format,
    )
    total = len(to_generate) + len(to_score)
    with ProgressBar(
        total=total, desc="eval", disable=not cfg.progress or total == 0, dynamic_ncols=True
    ) as bar:
        for task, q, pk, sk, rec in to_score:
            record(task, q, pk, sk, rec["response"], rec.get("agent"))
            bar.update(1)
        for start in range(0, len(to_generate), max(cfg.batch_size, 1)):
            chunk, samples = [], []
            for task, q, pk, sk in to_generate[start : start + cfg.batch_size]:
                try:
                    samples.append(query_sample(task, q, cfg.tools, cfg.max_turns))
                except Exception as exc:  # noqa: BLE001 - a corrupt image skips its query
                    skipped.append(
                        {
                            "task": task.name,
                            "query_idx": q.idx,
                            "reason": "unreadable_media",
                            "error": str(exc),
                        }
                    )
                    continue
                chunk.append((task, q, pk, sk))
            if samples:
                if cfg.tools:
                    from mmrl.rollout.multiturn import generate_trajectories

                    batch = generate_trajectories(engine, samples, params, agent_cfg)
                else:
                    batch = engine.generate(samples, params)
                trajectories = getattr(batch, "trajectories", None) or [None] * len(chunk)
                for (task, q, pk, sk), text, traj in zip(chunk, batch.texts, trajectories):
                    kept = None if traj is None else {k: getattr(traj, k) for k in TRAJECTORY_FIELDS}
                    record(task, q, pk, sk, text, kept)
                generated += len(chunk)
            bar.update(len(to_generate[start : start + cfg.batch_size]))

    skipped_by_task: dict[str, dict[str, int]] = {}
    for s in skipped:
        counts = skipped_by_task.setdefault(s["task"], {})
        counts[s["reason"]] = counts.get(s["reason"], 0) + 1
    results = []
    for task, queries in selected:
        recs = [cache.get(task.name, q.idx) for q in queries]
        skipped_idx = {s["query_idx"] for s in skipped if s["task"] == task.name}
        recs = [r for r, q in zip(recs, queries) if r is not None and q.idx not in skipped_idx]
        results.append(
            TaskResult(
                name=task.name,
                eval_type=task.eval_type,
                score=task_score(r["score"] for r in recs),
                num_queries=len(queries),
                num_scored=len(recs),
                skipped=skipped_by_task.get(task.name, {}),
                parse_failures=sum(1 for r in recs if not r["parse_ok"]),
                field_errors=sum(len(r["field_errors"]) for r in recs),
                metadata=task.metadata,
                agent=agent_summary(recs),
            )
        )
    for reason, n in summarize(results)["skipped"].items():
        log.warning("skipped %d queries: %s", n, reason)
    summary = {"suite": suite.path, "model": model_id, "scoring": cfg.scoring, **summarize(results)}
    if cfg.tools:
        all_recs = [cache.get(t.name, q.idx) for t, qs in selected for q in qs]
        summary["tools"] = list(cfg.tools)
        summary["agent"] = agent_summary([r for r in all_recs if r is not None])
    result = EvalResult(
        summary=summary,
        tasks=results,
        breakdown=keyword_breakdown(results),
        skipped_queries=skipped,
        generated=generated,
        rescored=generated + len(to_score),
        seconds=time.monotonic() - t0,
        output_dir=str(folder) if folder else None,
    )
    if folder is not None:
        write_outputs(result, folder)
    return result


# --------------------------------------------------------------------------- outputs


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def results_markdown(result: EvalResult) -> str:
    """Summary, per-task and per-keyword tables (scores in percent)."""
    s = result.summary
    lines = [
        f"# Evaluation of `{s.get('model')}`",
        "",
        f"Suite: `{s.get('suite')}`",
        "",
        f"Scoring: `{s.get('scoring', 'corrected')}` ("
        + (
            "MEGA-Bench's own definitions, comparable to published scores"
            if s.get("scoring") == "megabench"
            else "mmrl's corrected definitions, not comparable to published MEGA-Bench scores"
        )
        + ")",
        "",
        "| overall | Core | Open | micro | Core tasks | Open tasks | queries scored |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {_fmt(s['overall'])} | {_fmt(s['core'])} | {_fmt(s['open'])} | {_fmt(s['micro'])} | "
        f"{s['num_tasks']['core']} | {s['num_tasks']['open']} | {s['num_queries']} |",
        "",
        "| task | type | score | scored / queries | parse failures | skipped |",
        "|---|---|---:|---:|---:|---|",
    ]
    for t in result.tasks:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(t.skipped.items())) or "-"
        lines.append(
            f"| {t.name} | {t.eval_type.capitalize()} | {_fmt(t.score)} | {t.num_scored} / {t.num_queries} | "
            f"{t.parse_failures} | {skipped} |"
        )
    agent_tasks = [t for t in result.tasks if t.agent]
    if agent_tasks:
        lines += [
            "",
            f"## Tool use ({', '.join(s.get('tools', []))})",
            "",
            "| task | turns | tool calls | tool-call rate | error rate | time-outs | observation tokens | "
            "ended on an answer |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for t in agent_tasks:
            a = t.agent
            lines.append(
                f"| {t.name} | {a['turns']:.2f} | {a['tool_calls']:.2f} | {_fmt(a['tool_call_rate'])} | "
                f"{_fmt(a['tool_error_rate'])} | {_fmt(a['tool_timeout_rate'])} | "
                f"{a['observation_tokens']:.0f} | {_fmt(a['end_answer'])} |"
            )
    if s["skipped"]:
        lines += ["", "Skipped queries: " + ", ".join(f"{k} {v}" for k, v in sorted(s["skipped"].items()))]
    for dim, keywords in result.breakdown.items():
        lines += ["", f"## By {dim}", "", "| keyword | score | tasks |", "|---|---:|---:|"]
        lines += [f"| {kw} | {_fmt(v['score'])} | {v['num_tasks']} |" for kw, v in keywords.items()]
    return "\n".join(lines) + "\n"


def plot_results(result: EvalResult, out: Path) -> Path:
    """Horizontal bars of task scores, Core blue and Open orange, the overall mean dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in result.tasks if t.score is not None]
    fig, ax = plt.subplots(figsize=(7, 0.35 * max(len(tasks), 1) + 1.4))
    names = [t.name for t in tasks]
    scores = [100 * t.score for t in tasks]
    colours = ["tab:blue" if t.eval_type == "core" else "tab:orange" for t in tasks]
    ax.barh(range(len(tasks)), scores, color=colours)
    ax.set_yticks(range(len(tasks)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("score (%)")
    overall = result.summary.get("overall")
    if overall is not None:
        ax.axvline(
            100 * overall, color="k", linestyle="--", linewidth=1, label=f"overall {100 * overall:.1f}"
        )
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{Path(str(result.summary.get('model'))).name}: Core blue, Open orange", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_outputs(result: EvalResult, folder: Path) -> None:
    """results.json, results.md and results.png; a failed write (a full disk, a read-only
    folder) is a `StorageError` naming the file and the cause."""
    from mmrl.train.storage import storage_errors

    for name, write in (
        ("results.json", lambda p: p.write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")),
        ("results.md", lambda p: p.write_text(results_markdown(result), encoding="utf-8")),
        ("results.png", lambda p: plot_results(result, p)),
    ):
        with storage_errors("write the results to", folder / name, OUTPUT_KEPT):
            write(folder / name)


# --------------------------------------------------------------------------- judge


def load_judge(cfg: EvalConfig) -> Judge | None:
    """The judge named by `cfg.judge` (`module:attr`; a class is instantiated without arguments)
    or built from `cfg.judge_model` (a local VLM folder, `mmrl.rewards.vlm_judge.VLMJudge`)."""
    if cfg.judge and cfg.judge_model:
        raise ValueError("give --judge or --judge-model, not both")
    if cfg.judge_model:
        try:
            from mmrl.rewards.vlm_judge import VLMJudge
        except ImportError as exc:
            raise ValueError(f"--judge-model needs mmrl.rewards.vlm_judge ({exc})") from None
        return VLMJudge(model_path=cfg.judge_model).judge
    if not cfg.judge:
        return None
    module_name, _, attr = cfg.judge.partition(":")
    if not attr:
        raise ValueError(f"--judge {cfg.judge!r}: expected module:attr")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--judge {cfg.judge!r}: {exc}") from None
    if isinstance(obj, type):
        obj = obj()
        obj = getattr(obj, "judge", obj)
    if not callable(obj):
        raise ValueError(f"--judge {cfg.judge!r} is not callable")
    return obj


# --------------------------------------------------------------------------- trainer hook

_SUITES: dict[tuple[str, str | None], Suite] = {}


def evaluate_suite(
    policy_or_engine: Any,
    suite_path: str | Path | Suite | None = None,
    max_queries: int | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    judge: Judge | None = None,
    prefix: str = "eval_suite",
    per_task: bool = True,
    scoring: str = "megabench",
) -> dict[str, float]:
    """Evaluate in memory (no files, no cache) and return `eval_suite/...` metrics: `overall`,
    `core`, `open` (when there are such tasks), `queries`, `skipped`, `parse_failures` and
    `task/<name>` per task. The suite is loaded once per path; None is the built-in mini-suite."""
    if isinstance(suite_path, Suite):
        suite = suite_path
    else:
        if suite_path is None:
            from mmrl.eval.builtin import builtin_suite_path

            suite_path = builtin_suite_path()
        key = (str(Path(suite_path).resolve()), None)
        if key not in _SUITES:
            _SUITES[key] = load_suite(suite_path)
        suite = _SUITES[key]
    cfg = EvalConfig(
        max_queries=max_queries,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=False,
        scoring=scoring,
    )
    result = run_suite(policy_or_engine, suite, cfg, judge=judge, model_id="trainer")
    s = result.summary
    metrics = {
        f"{prefix}/queries": float(s["num_queries"]),
        f"{prefix}/skipped": float(sum(s["skipped"].values())),
    }
    metrics[f"{prefix}/parse_failures"] = float(s["parse_failures"])
    for key in ("overall", "core", "open"):
        if s[key] is not None:
            metrics[f"{prefix}/{key}"] = float(s[key])
    if per_task:
        for t in result.tasks:
            if t.score is not None:
                metrics[f"{prefix}/task/{t.name}"] = float(t.score)
    return metrics
