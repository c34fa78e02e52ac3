"""Suite loading: MEGA-Bench's task layout from JSON / JSONL / Parquet, and errors that say where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mmrl.eval.builtin import BUILTIN_TASKS, write_builtin_suite
from mmrl.eval.suite import SuiteError, import_hf_datasets, load_suite


def _image(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (200, 30, 30)).save(path)
    return path.name


def _task(name: str = "colours", n: int = 2, **overrides) -> dict:
    task = {
        "task_name": name,
        "task_description": "Name the colour.",
        "example_text": "",
        "example_media": [],
        "query_response": [
            {
                "query_idx": i,
                "query_text": "<image>What colour is it?",
                "query_media": ["red.png"],
                "correct_answer": {"Answer": "red"},
            }
            for i in range(n)
        ],
        "metric_info": {
            "field_score_function": {"Answer": "exact_str_match_case_insensitive"},
            "aggregation": {"function": "mean", "field_weights": {"Answer": 1}},
            "response_parse_function": "answer_string",
        },
    }
    task.update(overrides)
    return task


@pytest.fixture()
def suite_dir(tmp_path: Path) -> Path:
    _image(tmp_path / "red.png")
    return tmp_path


def test_a_task_file_loads_into_tasks_queries_and_prompts(suite_dir):
    (suite_dir / "colours.json").write_text(
        json.dumps(_task(example_text="Example: <image> red", example_media=["red.png"]))
    )
    suite = load_suite(suite_dir)
    (task,) = suite.tasks
    assert task.name == "colours" and task.eval_type == "core" and task.answer_fields == ["Answer"]
    text, media = task.prompt(task.queries[0])
    # Description, demonstration, query, in that order; media in placeholder order.
    assert text == "Name the colour.\nExample: <image> red\n<image>What colour is it?"
    assert [m.label for m in media] == ["red.png", "red.png"]
    assert not media[0].missing() and media[0].load().size == (16, 16)


def test_json_list_jsonl_and_metadata_file(suite_dir):
    (suite_dir / "two.json").write_text(json.dumps([_task("a"), _task("b")]))
    (suite_dir / "more.jsonl").write_text(json.dumps(_task("c")) + "\n\n" + json.dumps(_task("d")) + "\n")
    meta = {"a": {"skills": ["Colour"], "app": "Perception", "output_format": "exact_text"}}
    (suite_dir / "all_task_meta.json").write_text(json.dumps(meta))
    suite = load_suite(suite_dir)
    assert sorted(t.name for t in suite.tasks) == ["a", "b", "c", "d"]
    assert suite.task("a").metadata["skills"] == ["Colour"]


def test_hugging_face_rows_in_parquet_are_grouped_by_task(suite_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for task, answers in (("colours", ["red", "red"]), ("count", ["1"])):
        for i, answer in enumerate(answers):
            rows.append(
                {
                    "id": f"{task}-{i}",
                    "task_name": task,
                    "task_description": "Look.",
                    "example_text": "",
                    "example_media": "[]",
                    "global_media": "[]",
                    "query_text": "<image>Q?",
                    "query_media": "['red.png']",
                    "answer": repr({"Answer": answer}),  # MEGA-Bench keeps these as Python literals
                    "metric_info": repr(
                        {
                            "field_score_function": {"Answer": "exact_str_match"},
                            "aggregation": {"function": "mean", "field_weights": {"Answer": 1}},
                            "response_parse_function": "answer_string",
                        }
                    ),
                    "eval_context": "{}",
                    "application": "Perception",
                }
            )
    pq.write_table(pa.Table.from_pylist(rows), suite_dir / "core.parquet")
    suite = load_suite(suite_dir / "core.parquet")
    assert [(t.name, len(t.queries)) for t in suite.tasks] == [("colours", 2), ("count", 1)]
    q = suite.task("colours").queries[1]
    assert q.idx == 1 and q.id == "colours-1" and q.answer == {"Answer": "red"}
    assert suite.task("count").metadata["app"] == "Perception"


def test_a_datasets_export_is_read_when_the_library_is_installed(suite_dir):
    try:
        datasets = import_hf_datasets()  # from the repository root, ./datasets/ would shadow it
    except ImportError:
        pytest.skip("the Hugging Face datasets library is not installed")
    rows = {
        "task_name": ["colours"],
        "query_text": ["<image>Q?"],
        "query_media": [["red.png"]],
        "answer": [repr({"Answer": "red"})],
        "metric_info": [repr({"field_score_function": {"Answer": "exact_str_match"}})],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(str(suite_dir / "export"))
    suite = load_suite(suite_dir / "export", media_root=suite_dir)
    assert suite.task("colours").queries[0].answer == {"Answer": "red"}


def test_a_datasets_export_without_the_library_fails_clearly(suite_dir, monkeypatch):
    import sys

    export = suite_dir / "export"
    export.mkdir()
    (export / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(SuiteError, match="install `datasets`"):
        load_suite(export)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"metric_info": {"field_score_function": {"Answer": "exact_str_mach"}}},
            "did you mean 'exact_str_match'",
        ),
        (
            {"metric_info": {"field_score_function": {"Other": "exact_str_match"}}},
            "no metric for answer field 'Answer'",
        ),
        ({"metric_info": None}, "field 'metric_info': missing"),
        ({"query_response": []}, "no queries"),
        (
            {
                "query_response": [
                    {
                        "query_text": "<image><image>Q",
                        "query_media": ["red.png"],
                        "correct_answer": {"Answer": "x"},
                    }
                ]
            },
            "2 <image>/<video> placeholder",
        ),
        (
            {"query_response": [{"query_text": "Q", "correct_answer": {}}]},
            "correct_answer'.*missing or empty",
        ),
        (
            {"query_response": [{"query_idx": 0, "query_text": "Q", "correct_answer": {"Answer": "x"}}] * 2},
            "duplicate query_idx 0",
        ),
        (
            {
                "metric_info": {
                    "field_score_function": {"Answer": "exact_str_match"},
                    "aggregation": {"function": "median"},
                }
            },
            "unknown aggregation 'median'",
        ),
        (
            {
                "metric_info": {
                    "field_score_function": {"Answer": "exact_str_match"},
                    "response_parse_function": "odd",
                }
            },
            "unknown parser 'odd'",
        ),
    ],
)
def test_malformed_tasks_fail_with_the_file_and_the_task_name(suite_dir, change, message):
    path = suite_dir / "broken.json"
    path.write_text(json.dumps(_task("broken_task", **change)))
    with pytest.raises(SuiteError, match=message) as info:
        load_suite(suite_dir)
    assert str(path) in str(info.value) and "'broken_task'" in str(info.value)


def test_unparsable_files_and_duplicate_names_fail_with_the_file(suite_dir):
    (suite_dir / "bad.json").write_text('{"task_name": "x",')
    with pytest.raises(SuiteError, match=r"bad\.json:1: invalid JSON"):
        load_suite(suite_dir)
    (suite_dir / "bad.json").write_text(json.dumps({"no_name": 1, "query_response": []}))
    with pytest.raises(SuiteError, match="task_name"):
        load_suite(suite_dir)
    (suite_dir / "bad.json").write_text(json.dumps(_task("same")))
    (suite_dir / "again.json").write_text(json.dumps(_task("same")))
    with pytest.raises(SuiteError, match="duplicate task name"):
        load_suite(suite_dir)


def test_a_single_field_parser_on_a_multi_field_answer_is_an_error(suite_dir):
    task = _task()
    for q in task["query_response"]:
        q["correct_answer"] = {"a": "1", "b": "2"}
    task["metric_info"]["field_score_function"] = {"a": "exact_str_match", "b": "exact_str_match"}
    (suite_dir / "t.json").write_text(json.dumps(task))
    with pytest.raises(SuiteError, match="reads one answer field"):
        load_suite(suite_dir)


def test_missing_media_does_not_fail_the_load(suite_dir):
    task = _task()
    task["query_response"][1]["query_media"] = ["gone.png"]
    (suite_dir / "t.json").write_text(json.dumps(task))
    q0, q1 = load_suite(suite_dir).tasks[0].queries
    assert not q0.media[0].missing() and q1.media[0].missing()


def test_judge_tasks_are_open_and_unsupported_metrics_are_known(suite_dir):
    judged = _task("judged", metric_info={"field_score_function": {"Answer": "gpt_4o_as_judge"}})
    nli = _task("nli", metric_info={"field_score_function": {"Answer": "nli_entailment"}})
    coded = _task("coded", metric_info={"field_score_function": {"Answer": "program_judge"}})
    (suite_dir / "t.json").write_text(json.dumps([judged, nli, coded]))
    suite = load_suite(suite_dir)
    assert suite.task("judged").eval_type == "open"
    assert suite.task("nli").eval_type == "core" and suite.task("nli").unsupported_metrics() == [
        "nli_entailment"
    ]
    assert suite.task("coded").unsupported_metrics() == []  # program_judge runs, in a sandbox


def test_the_builtin_suite_is_a_valid_suite(tmp_path):
    write_builtin_suite(tmp_path, queries_per_task=2)
    suite = load_suite(tmp_path)
    assert sorted(t.name for t in suite.tasks) == sorted(BUILTIN_TASKS)
    assert all(len(t.queries) == 2 and t.eval_type == "core" for t in suite.tasks)
    bars = suite.task("bar_chart_values")
    assert bars.answer_fields == ["A", "B", "C"] and bars.metric_info.response_parse_function == "json"
    text, media = suite.task("counting").prompt(suite.task("counting").queries[0])
    assert text.count("<image>") == len(media) == 2  # demonstration + query
    assert "Answer: " in text
    assert all(not m.missing() for t in suite.tasks for q in t.queries for m in t.prompt(q)[1])


def test_eval_outputs_inside_a_suite_folder_are_not_read_as_tasks(suite_dir):
    (suite_dir / "colours.json").write_text(json.dumps(_task()))
    out = suite_dir / "eval-out"
    out.mkdir()
    for name in ("results.json", "run.json", "pass_at_k.json", "curves.json"):
        (out / name).write_text("{}")
    (out / "queries.jsonl").write_text('{"task": "colours", "query_idx": 0}\n')
    assert [t.name for t in load_suite(suite_dir).tasks] == ["colours"]
