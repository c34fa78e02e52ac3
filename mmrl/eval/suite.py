"""Evaluation suites in MEGA-Bench's task format, and loading them from disk.

A **task** (one JSON object; MEGA-Bench's layout):

```json
{"task_name": "counting",
 "task_description": "Count the shapes in the image.",
 "global_media": [],
 "example_text": "Example 1:\\n<image>\\nExample Question: ...\\nExample Response:\\nAnswer: 3",
 "example_media": ["images/demo.png"],
 "query_response": [
   {"query_idx": 0, "query_text": "<image>How many shapes?", "query_media": ["images/0.png"],
    "correct_answer": {"Answer": "4"}, "eval_context": {}}],
 "metric_info": {"field_score_function": {"Answer": "positive_int_match"},
                 "aggregation": {"function": "mean", "field_weights": {"Answer": 1}},
                 "response_parse_function": "answer_string"},
 "metadata": {"skills": ["Counting"], "input_format": "Photographs",
              "output_format": "numerical_data", "app": "Perception"}}
```

The model sees one user turn: description, demonstration and query text, in that order, with
the global, demonstration and query media at their `<image>` placeholders. An answer has one or
more named fields; fields whose name starts with `##` are auxiliary (scored only if they have a
metric). Tasks whose metrics include a judge are Open, the others Core.

**Files.** A suite is a folder (searched recursively) or one file:

- `.json`: a task, a list of tasks, or `{"tasks": [...]}`;
- `.jsonl`: one task per line, or one *query row* per line;
- `.parquet`: task rows or query rows;
- a Hugging Face `datasets` export (`save_to_disk`, with `state.json` / `dataset_dict.json`),
  read with `datasets.load_from_disk` when that library is installed.

A *query row* is MEGA-Bench's Hugging Face layout: `task_name`, `task_description`,
`example_text`, `example_media`, `global_media`, `query_text`, `query_media`, `answer`,
`metric_info`, `eval_context` (the last three may be Python-literal strings), optional `id` and
metadata columns; rows are grouped by task name and numbered in order. `all_task_meta.json` /
`task_meta.json` in the folder (MEGA-Bench's metadata file, keyed by task name) adds metadata.

Media are paths (relative to `media_root`, else the task file's folder), bytes, base64 strings
(`data:image/...;base64,` or bare) or `{"bytes": ..., "path": ...}` objects. A missing media
file does not fail the load: the query is marked and the runner skips and counts it. A malformed
task does fail it, with a `SuiteError` naming the file and the task.
"""

from __future__ import annotations

import ast
import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.eval import task_metrics  # noqa: F401 - its scorers register in both metric registries
from mmrl.eval.metrics import UNSUPPORTED, get_metric, is_judge_metric
from mmrl.eval.parsers import PARSERS, SINGLE_FIELD_PARSERS

META_FILES = ("all_task_meta.json", "task_meta.json")
"""Per-suite metadata files (task name -> keywords), never read as tasks."""
_SKIP_FILES = {
    *META_FILES,
    *("dataset_info.json", "state.json", "dataset_dict.json"),  # `datasets` exports
    *("run.json", "results.json", "queries.jsonl", "pass_at_k.json", "curves.json"),  # mmrl eval outputs
}
_VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".gif"}
_PLACEHOLDER = re.compile(r"<image>|<video>")
_METADATA_KEYS = (
    "skills",
    "input_format",
    "output_format",
    "app",
    "application",
    "num_input",
    "taxonomy_tree_path",
)
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


class SuiteError(ValueError):
    """A malformed suite file or task; the message names the file, the task and the field."""

    def __init__(self, where: str, task: str | None, problem: str):
        self.where = where
        self.task = task
        self.problem = problem
        task_part = f": task {task!r}" if task else ""
        super().__init__(f"{where}{task_part}: {problem}")


@dataclass
class Media:
    """One image reference, resolved but not decoded."""

    source: str | bytes
    """A path on disk, or the encoded bytes."""
    label: str
    """How it is named in messages and fingerprints (the path, or `<N bytes sha1=...>`)."""

    @property
    def is_video(self) -> bool:
        return isinstance(self.source, str) and Path(self.source).suffix.lower() in _VIDEO_SUFFIXES

    def missing(self) -> bool:
        return isinstance(self.source, str) and not Path(self.source).is_file()

    def load(self):
        from mmrl.types import load_image

        return load_image(self.source)


@dataclass
class MetricInfo:
    """How a task's responses are parsed and scored."""

    field_score_function: dict[str, str]
    """Answer field -> metric name."""
    aggregation: str = "mean"
    """`mean` (weighted) or `min` over the fields."""
    field_weights: dict[str, float] = field(default_factory=dict)
    """Answer field -> weight in the mean (1 when absent)."""
    response_parse_function: str = "answer_string"
    """Parser name (see `mmrl.eval.parsers.PARSERS`)."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The metric_info as given (judge configs and other extras)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "field_score_function": self.field_score_function,
            "aggregation": {"function": self.aggregation, "field_weights": self.field_weights},
            "response_parse_function": self.response_parse_function,
        }


@dataclass
class Query:
    """One question of a task."""

    idx: int
    """`query_idx`, unique within the task."""
    text: str
    """Query text with `<image>` placeholders."""
    media: list[Media]
    """The query's own media, in placeholder order."""
    answer: dict[str, Any]
    """Reference answer per field."""
    eval_context: dict[str, Any] = field(default_factory=dict)
    """Extra information some metrics need."""
    id: str | None = None
    """A global id when the suite gives one."""


@dataclass
class Task:
    """One MEGA-Bench task."""

    name: str
    description: str
    example_text: str
    example_media: list[Media]
    global_media: list[Media]
    queries: list[Query]
    metric_info: MetricInfo
    metadata: dict[str, Any] = field(default_factory=dict)
    """Keywords for breakdowns (skills, input_format, output_format, app, num_input)."""
    source: str = ""
    """The file it was read from."""

    @property
    def eval_type(self) -> str:
        """`open` when any field is judge-scored, else `core`."""
        metrics = self.metric_info.field_score_function.values()
        return "open" if any(is_judge_metric(m) for m in metrics) else "core"

    @property
    def answer_fields(self) -> list[str]:
        """The reference's fields that are not auxiliary (`##...`)."""
        return [f for f in self.queries[0].answer if not f.startswith("##")] if self.queries else []

    def unsupported_metrics(self) -> list[str]:
        return sorted({m for m in self.metric_info.field_score_function.values() if m in UNSUPPORTED})

    def prompt(self, query: Query) -> tuple[str, list[Media]]:
        """The user turn's text (placeholders in place) and its media in placeholder order."""
        parts = [p.strip() for p in (self.description, self.example_text, query.text)]
        text = "\n".join(p for p in parts if p)
        return text, [*self.global_media, *self.example_media, *query.media]

    def fingerprint(self, query: Query) -> str:
        """Changes whenever what the model sees changes (text or media)."""
        text, media = self.prompt(query)
        return _sha1([text, [m.label for m in media]])

    def score_fingerprint(self, query: Query) -> str:
        """Changes whenever the scoring of a fixed response would."""
        return _sha1([query.answer, self.metric_info.to_json(), query.eval_context])


@dataclass
class Suite:
    """The tasks of one suite."""

    tasks: list[Task]
    path: str = ""

    def task(self, name: str) -> Task:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(
            f"no task {name!r} in suite {self.path} (tasks: {', '.join(t.name for t in self.tasks)})"
        )

    @property
    def num_queries(self) -> int:
        return sum(len(t.queries) for t in self.tasks)


def _sha1(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def load_suite(path: str | Path, media_root: str | Path | None = None) -> Suite:
    """Read every task under `path` (a folder or one file) and validate it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"suite not found: {path}")
    root = path if path.is_dir() else path.parent
    tasks: list[Task] = []
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        tasks = _tasks_from_rows(_read_hf_export(path), str(path), root, media_root)
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in (".json", ".jsonl", ".parquet")
            and p.name not in _SKIP_FILES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise SuiteError(str(path), None, "no .json, .jsonl or .parquet task files in this folder")
        for f in files:
            tasks.extend(_read_file(f, media_root))
    else:
        tasks = _read_file(path, media_root)
    seen: dict[str, str] = {}
    for t in tasks:
        if t.name in seen:
            raise SuiteError(t.source, t.name, f"duplicate task name (also in {seen[t.name]})")
        seen[t.name] = t.source
    meta = _read_meta(root)
    for t in tasks:
        for key, value in meta.get(t.name, {}).items():
            t.metadata.setdefault(key, value)
    return Suite(tasks=tasks, path=str(path))


def _read_meta(root: Path) -> dict[str, dict[str, Any]]:
    for name in META_FILES:
        f = root / name
        if f.exists():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise SuiteError(f"{f}:{exc.lineno}", None, f"invalid JSON: {exc.msg}") from None
            if not isinstance(data, dict):
                raise SuiteError(str(f), None, "must map task names to metadata objects")
            return {k: _metadata(v) for k, v in data.items() if isinstance(v, dict)}
    return {}


def _read_file(path: Path, media_root: str | Path | None) -> list[Task]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return _tasks_from_records([(f"{path} row {i}", r) for i, r in enumerate(rows)], path, media_root)
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{path}:{exc.lineno}", None, f"invalid JSON: {exc.msg}") from None
        if isinstance(data, dict) and "tasks" in data and "task_name" not in data:
            data = data["tasks"]
        records = data if isinstance(data, list) else [data]
        return _tasks_from_records([(f"{path} item {i}", r) for i, r in enumerate(records)], path, media_root)
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{path}:{lineno}", None, f"invalid JSON: {exc.msg}") from None
    return _tasks_from_records(records, path, media_root)


def _tasks_from_records(records: list[tuple[str, Any]], path: Path, media_root) -> list[Task]:
    """Records that hold `query_response` are whole tasks; the others are query rows."""
    tasks, rows = [], []
    for where, record in records:
        if not isinstance(record, dict):
            raise SuiteError(where, None, f"expected a task object, got {type(record).__name__}")
        if "query_response" in record:
            tasks.append(_task_from_record(record, where, path, media_root))
        else:
            rows.append((where, record))
    if rows:
        tasks.extend(_tasks_from_rows(rows, str(path), path.parent, media_root))
    return tasks


def import_hf_datasets() -> Any:
    """The Hugging Face `datasets` library, even where this repository's own top-level
    `datasets/` folder (the source of `mmrl.datasets`) shadows it: Python puts the current
    directory first on `sys.path` for `python -m ...` and `python -c`, so from the repository
    root `import datasets` finds the folder. Raises ImportError if the library is missing."""
    import importlib
    import sys

    module = importlib.import_module("datasets")
    if hasattr(module, "load_from_disk"):
        return module
    shadow = Path(module.__file__).resolve().parent.parent
    for name in [n for n in sys.modules if n == "datasets" or n.startswith("datasets.")]:
        del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != shadow]
    try:
        module = importlib.import_module("datasets")
    finally:
        sys.path[:] = saved
    if not hasattr(module, "load_from_disk"):
        raise ImportError(f"`import datasets` finds {module.__file__}, not the Hugging Face library")
    return module


def _read_hf_export(path: Path) -> list[tuple[str, dict]]:
    try:
        datasets = import_hf_datasets()
    except ImportError:
        raise SuiteError(
            str(path),
            None,
            "this is a Hugging Face `datasets` export (save_to_disk); install `datasets` to read it, "
            "or export the rows to Parquet/JSONL",
        ) from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        splits = [data["test"]] if "test" in data else list(data.values())
    else:
        splits = [data]
    rows = []
    for split in splits:
        for i, row in enumerate(split):
            rows.append((f"{path} row {i}", dict(row)))
    return rows


def _tasks_from_rows(rows: list[tuple[str, dict]], where: str, base: Path, media_root) -> list[Task]:
    """Group MEGA-Bench's Hugging Face rows (one per query) into tasks."""
    grouped: dict[str, list[tuple[str, dict]]] = {}
    for row_where, row in rows:
        name = row.get("task_name")
        if not isinstance(name, str) or not name:
            raise SuiteError(row_where, None, "field 'task_name': missing (every row names its task)")
        grouped.setdefault(name, []).append((row_where, row))
    tasks = []
    for name, task_rows in grouped.items():
        first_where, first = task_rows[0]
        for row_where, row in task_rows[1:]:
            for key in ("task_description", "example_text", "example_media", "global_media", "metric_info"):
                if str(row.get(key, "")) != str(first.get(key, "")):
                    raise SuiteError(
                        row_where, name, f"field {key!r} differs from the task's first row ({first_where})"
                    )
        record = {
            "task_name": name,
            "task_description": first.get("task_description", ""),
            "example_text": first.get("example_text", ""),
            "example_media": first.get("example_media", []),
            "global_media": first.get("global_media", []),
            "metric_info": first.get("metric_info"),
            "metadata": {k: first[k] for k in _METADATA_KEYS if first.get(k) is not None},
            "query_response": [
                {
                    "query_idx": i,
                    "query_text": row.get("query_text", ""),
                    "query_media": row.get("query_media", []),
                    "correct_answer": row.get("answer", row.get("correct_answer")),
                    "eval_context": row.get("eval_context", {}),
                    "id": row.get("id"),
                }
                for i, (_, row) in enumerate(task_rows)
            ],
        }
        tasks.append(_task_from_record(record, first_where, Path(where), media_root, base=base))
    return tasks


def _literal_field(value: Any, fail, field_name: str, expected: type) -> Any:
    """MEGA-Bench's HF rows keep dicts / lists as Python-literal strings."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str) and expected is not str:
        text = value.strip()
        if not text:
            return expected()
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise fail(
                    field_name, f"not a {expected.__name__} (nor a literal of one): {text[:80]!r}"
                ) from None
    if value is None:
        return expected()
    if not isinstance(value, expected):
        raise fail(field_name, f"must be a {expected.__name__}, got {type(value).__name__}")
    return value


def _metadata(value: dict[str, Any]) -> dict[str, Any]:
    meta = dict(value)
    if "application" in meta and "app" not in meta:
        meta["app"] = meta["application"]
    if isinstance(meta.get("skills"), str):
        meta["skills"] = (
            [s.strip() for s in meta["skills"].split(";") if s.strip()]
            if ";" in meta["skills"]
            else [meta["skills"]]
        )
    return meta


def _task_from_record(record: dict, where: str, path: Path, media_root, base: Path | None = None) -> Task:
    name = record.get("task_name")
    if not isinstance(name, str) or not name.strip():
        raise SuiteError(where, None, "field 'task_name': missing or not a non-empty string")

    def fail(field_name: str, problem: str) -> SuiteError:
        return SuiteError(where, name, f"field {field_name!r}: {problem}")

    bases = [Path(media_root)] if media_root else []
    bases.append(base if base is not None else path.parent)

    def media_list(value: Any, field_name: str) -> list[Media]:
        items = _literal_field(value, fail, field_name, list)
        return [_media(item, bases, f"{field_name}[{i}]", fail) for i, item in enumerate(items)]

    description = _literal_field(
        record.get("task_description", record.get("global_description", "")), fail, "task_description", str
    )
    example_text = record.get("example_text", "")
    example_media = record.get("example_media", [])
    if isinstance(record.get("example_info"), dict):  # MEGA-Bench's result-file layout
        example_text = record["example_info"].get("example_text", example_text)
        example_media = record["example_info"].get("image_paths", example_media)
    example_text = _literal_field(example_text, fail, "example_text", str)
    task = Task(
        name=name,
        description=description,
        example_text=example_text,
        example_media=media_list(example_media, "example_media"),
        global_media=media_list(record.get("global_media", record.get("global_images", [])), "global_media"),
        queries=[],
        metric_info=_metric_info(record.get("metric_info"), fail),
        metadata=_metadata(_literal_field(record.get("metadata", {}), fail, "metadata", dict)),
        source=str(path),
    )
    for key in _METADATA_KEYS:
        if record.get(key) is not None and key not in task.metadata:
            task.metadata.update(_metadata({key: record[key]}))
    for text_field, text, media in (
        ("task_description", task.description, task.global_media),
        ("example_text", task.example_text, task.example_media),
    ):
        n = len(_PLACEHOLDER.findall(text))
        if n != len(media):
            raise fail(
                text_field, f"has {n} <image>/<video> placeholder(s) for {len(media)} media; they must match"
            )

    queries = _literal_field(record.get("query_response"), fail, "query_response", list)
    if not queries:
        raise fail("query_response", "no queries")
    seen: set[int] = set()
    for i, q in enumerate(queries):
        qf = f"query_response[{i}]"
        if not isinstance(q, dict):
            raise fail(qf, f"must be an object, got {type(q).__name__}")
        idx = q.get("query_idx", i)
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise fail(f"{qf}.query_idx", f"must be an integer, got {idx!r}")
        if idx in seen:
            raise fail(f"{qf}.query_idx", f"duplicate query_idx {idx}")
        seen.add(idx)
        answer = _literal_field(q.get("correct_answer"), fail, f"{qf}.correct_answer", dict)
        if not answer:
            raise fail(f"{qf}.correct_answer", "missing or empty (an object of answer fields)")
        text = _literal_field(q.get("query_text", ""), fail, f"{qf}.query_text", str)
        query = Query(
            idx=idx,
            text=text,
            media=media_list(q.get("query_media", []), f"{qf}.query_media"),
            answer=answer,
            eval_context=_literal_field(q.get("eval_context", {}), fail, f"{qf}.eval_context", dict),
            id=None if q.get("id") is None else str(q.get("id")),
        )
        n = len(_PLACEHOLDER.findall(text))
        if n != len(query.media):
            raise fail(
                f"{qf}.query_text", f"has {n} <image>/<video> placeholder(s) for {len(query.media)} media"
            )
        if i and set(query.answer) != set(task.queries[0].answer):
            raise fail(
                f"{qf}.correct_answer",
                f"fields {sorted(query.answer)} differ from the first query's {sorted(task.queries[0].answer)}",
            )
        task.queries.append(query)

    info = task.metric_info
    for f in task.answer_fields:
        if f not in info.field_score_function:
            raise fail("metric_info.field_score_function", f"no metric for answer field {f!r}")
    if info.response_parse_function in SINGLE_FIELD_PARSERS and len(task.answer_fields) != 1:
        raise fail(
            "metric_info.response_parse_function",
            f"{info.response_parse_function!r} reads one answer field; the answers have {task.answer_fields}",
        )
    return task


def _metric_info(value: Any, fail) -> MetricInfo:
    raw = _literal_field(value, fail, "metric_info", dict)
    if not raw:
        raise fail("metric_info", "missing")
    scores = raw.get("field_score_function")
    if not isinstance(scores, dict) or not scores:
        raise fail("metric_info.field_score_function", "must map answer fields to metric names")
    for f, m in scores.items():
        if not isinstance(m, str):
            raise fail(f"metric_info.field_score_function.{f}", f"must be a metric name, got {m!r}")
        if m not in UNSUPPORTED:
            try:
                get_metric(m)
            except KeyError as exc:
                raise fail(f"metric_info.field_score_function.{f}", str(exc.args[0])) from None
    agg = raw.get("aggregation") or {}
    if not isinstance(agg, dict):
        raise fail("metric_info.aggregation", "must be an object {function, field_weights}")
    function = agg.get("function") or "mean"
    if function not in ("mean", "min"):
        raise fail("metric_info.aggregation.function", f"unknown aggregation {function!r} (known: mean, min)")
    weights = agg.get("field_weights") or {}
    if not isinstance(weights, dict):
        raise fail("metric_info.aggregation.field_weights", "must map fields to numbers")
    for f, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise fail(f"metric_info.aggregation.field_weights.{f}", f"must be a number >= 0, got {w!r}")
    parser = raw.get("response_parse_function") or "answer_string"
    if parser not in PARSERS:
        raise fail(
            "metric_info.response_parse_function", f"unknown parser {parser!r} (known: {', '.join(PARSERS)})"
        )
    return MetricInfo(
        field_score_function=dict(scores),
        aggregation=function,
        field_weights={f: float(w) for f, w in weights.items()},
        response_parse_function=parser,
        raw=raw,
    )


def _media(item: Any, bases: list[Path], field_name: str, fail) -> Media:
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path") or item.get("image")
        if item is None:
            raise fail(field_name, "media object needs 'bytes' or 'path'")
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
        return Media(data, f"<{len(data)} bytes sha1={hashlib.sha1(data).hexdigest()[:12]}>")
    if not isinstance(item, str) or not item:
        raise fail(field_name, f"must be a path, bytes or base64 string, got {type(item).__name__}")
    if item.startswith("data:") and ";base64," in item:
        return _b64_media(item.split(";base64,", 1)[1], field_name, fail)
    candidate = Path(item)
    if candidate.is_absolute():
        return Media(str(candidate), item)
    for base in bases:
        if (base / candidate).exists():
            return Media(str(base / candidate), item)
    if len(item) >= 128 and _BASE64.fullmatch(item[:4096]):
        return _b64_media(item, field_name, fail)
    return Media(str(bases[0] / candidate), item)  # missing: reported when the query is run


def _b64_media(text: str, field_name: str, fail) -> Media:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise fail(field_name, "neither an existing path nor valid base64") from None
    return Media(data, f"<{len(data)} bytes sha1={hashlib.sha1(data).hexdigest()[:12]}>")


def write_task(task_record: dict[str, Any], path: str | Path) -> Path:
    """Write one task record as JSON (used by the built-in suite and tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(task_record, indent=1, ensure_ascii=False), encoding="utf-8")
    return path


def image_bytes(image) -> bytes:
    """PNG bytes of a PIL image."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
