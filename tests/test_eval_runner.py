"""The runner: a saved tiny model on the built-in mini-suite end to end (outputs, resuming), and
scripted engines for skipping, judging, re-scoring and the trainer hook."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from mmrl.eval.builtin import BUILTIN_TASKS, write_builtin_suite
from mmrl.eval.command import add_eval_arguments, run_eval_command
from mmrl.eval.config import EvalConfig
from mmrl.eval.runner import evaluate_suite, run_suite
from mmrl.eval.suite import load_suite
from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm
from mmrl.rollout.hf import HFRolloutEngine


class ScriptedEngine:
    """Answers each query from a table keyed by `task/query_idx`; counts generate calls."""

    def __init__(self, answers: dict[str, str], default: str = ""):
        self.answers = answers
        self.default = default
        self.calls = 0
        self.prompts: list[str] = []

    def generate(self, samples, params):
        self.calls += 1
        self.prompts += [s.prompt[0]["content"] for s in samples]
        return SimpleNamespace(
            texts=[self.answers.get(s.id, self.default) for s in samples for _ in range(params.n)]
        )


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mmrl eval")
    add_eval_arguments(parser)
    return parser.parse_args(argv)


def _write_suite(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (10, 200, 10)).save(folder / "green.png")

    def task(name, metrics, answers, parser="answer_string", media=None, **extra):
        fields = list(answers[0])
        return {
            "task_name": name,
            "task_description": f"Task {name}.",
            "query_response": [
                {
                    "query_idx": i,
                    "query_text": "<image>Question?",
                    "query_media": [media[i] if media else "green.png"],
                    "correct_answer": a,
                    **extra,
                }
                for i, a in enumerate(answers)
            ],
            "metric_info": {
                "field_score_function": dict(zip(fields, metrics)),
                "aggregation": {"function": "mean", "field_weights": {f: 1 for f in fields}},
                "response_parse_function": parser,
            },
            "metadata": {"skills": ["Colour"]},
        }

    tasks = [
        task("colour", ["exact_str_match_case_insensitive"], [{"Answer": "green"}, {"Answer": "green"}]),
        task(
            "pair",
            ["exact_str_match", "positive_int_match"],
            [{"colour": "green", "count": "1"}, {"colour": "green", "count": "0"}],
            parser="json",
        ),
        task("describe", ["gpt_4o_as_judge"], [{"Answer": "a green square"}]),
        task(
            "lost", ["exact_str_match"], [{"Answer": "x"}, {"Answer": "y"}], media=["green.png", "gone.png"]
        ),
        task("entail", ["nli_entailment"], [{"Answer": "yes"}]),
    ]
    for t in tasks:
        (folder / f"{t['task_name']}.json").write_text(json.dumps(t))
    return folder


ANSWERS = {
    "colour/0": "It is GREEN.\nAnswer: green",
    "colour/1": "Answer: red",
    "pair/0": 'Here: {"colour": "green", "count": 1}',
    "pair/1": "{broken json",  # parse fails: the raw text is scored for every field
    "describe/0": "a green square",
    "lost/0": "Answer: x",
}


def test_scripted_run_scores_skips_and_counts(tmp_path):
    suite = load_suite(_write_suite(tmp_path / "suite"))
    engine = ScriptedEngine(ANSWERS)
    cfg = EvalConfig(output_dir=str(tmp_path / "out"), progress=False, scoring="corrected")
    result = run_suite(engine, suite, cfg)
    by = {t.name: t for t in result.tasks}
    assert by["colour"].score == pytest.approx(0.5)
    # pair/0: both fields right (1); pair/1: raw text scores 0 on colour, and count "0" vs "{broken
    # json" is 0 -> 0. Mean 0.5, one parse failure.
    assert by["pair"].score == pytest.approx(0.5) and by["pair"].parse_failures == 1
    # MEGA-Bench's own scoring: the JSON value 1 (an int, not text) is no literal to read for
    # positive_int_match, so pair/0 scores (1 + 0) / 2 and the task 0.25.
    megabench = run_suite(engine, suite, EvalConfig(output_dir=str(tmp_path / "mb"), progress=False))
    assert {t.name: t for t in megabench.tasks}["pair"].score == pytest.approx(0.25)
    # No judge configured: the Open task is skipped, not crashed.
    assert by["describe"].score is None and by["describe"].skipped == {"needs_judge": 1}
    # The query whose image is missing is skipped and counted; the other one is scored.
    assert by["lost"].skipped == {"missing_media": 1} and by["lost"].num_scored == 1 and by["lost"].score == 1
    assert by["entail"].skipped == {"unsupported_metric": 1}
    s = result.summary
    assert s["skipped"] == {"needs_judge": 1, "missing_media": 1, "unsupported_metric": 1}
    assert s["core"] == pytest.approx((0.5 + 0.5 + 1.0) / 3) and s["open"] is None
    assert {"task": "lost", "query_idx": 1, "reason": "missing_media"} in result.skipped_queries
    assert result.generated == 5
    # The prompt is description + query text with the image placeholder.
    assert "Task colour.\n<image>Question?" in engine.prompts


def test_a_stub_judge_scores_open_tasks(tmp_path):
    suite = load_suite(_write_suite(tmp_path / "suite"))
    seen = []

    def judge(prompt, response, reference):
        seen.append((prompt, response, reference))
        return 1.0 if response == reference else 0.25

    result = run_suite(ScriptedEngine(ANSWERS), suite, EvalConfig(progress=False), judge=judge)
    by = {t.name: t for t in result.tasks}
    assert by["describe"].eval_type == "open" and by["describe"].score == 1.0
    assert seen == [("Task describe.\n[image]Question?", "a green square", "a green square")]
    assert result.summary["open"] == 1.0
    # colour 0.5, pair 0.25 (MEGA-Bench's scoring, the default: see the scripted run), lost 1, describe 1
    assert result.summary["overall"] == pytest.approx((0.5 + 0.25 + 1.0 + 1.0) / 4)


def test_changed_references_are_rescored_without_generating(tmp_path):
    folder = _write_suite(tmp_path / "suite")
    cfg = EvalConfig(output_dir=str(tmp_path / "out"), progress=False)
    run_suite(ScriptedEngine(ANSWERS), load_suite(folder), cfg, model_id="m")
    task = json.loads((folder / "colour.json").read_text())
    task["query_response"][1]["correct_answer"] = {"Answer": "red"}
    (folder / "colour.json").write_text(json.dumps(task))
    engine = ScriptedEngine({})  # would answer "" to everything
    result = run_suite(engine, load_suite(folder), cfg, model_id="m")
    assert engine.calls == 0 and result.generated == 0 and result.rescored == 1
    assert {t.name: t.score for t in result.tasks}["colour"] == 1.0


def test_an_output_folder_of_another_model_is_refused(tmp_path):
    suite = load_suite(_write_suite(tmp_path / "suite"))
    cfg = EvalConfig(output_dir=str(tmp_path / "out"), progress=False)
    run_suite(ScriptedEngine(ANSWERS), suite, cfg, model_id="first")
    with pytest.raises(ValueError, match="holds results for model 'first'"):
        run_suite(ScriptedEngine(ANSWERS), suite, cfg, model_id="second")
    cfg.overwrite = True
    engine = ScriptedEngine(ANSWERS)
    run_suite(engine, suite, cfg, model_id="second")
    assert engine.calls == 1  # everything redone


def test_metric_errors_are_recorded_not_silent(tmp_path):
    folder = tmp_path / "suite"
    folder.mkdir()
    task = {
        "task_name": "point",
        "query_response": [{"query_text": "Where?", "correct_answer": {"Answer": "<point>0.5, 0.5</point>"}}],
        "metric_info": {  # no eval_context
            "field_score_function": {"Answer": "xml_norm_point_in_bbox"},
            "aggregation": {"function": "mean", "field_weights": {"Answer": 1}},
        },
    }
    (folder / "point.json").write_text(json.dumps(task))
    cfg = EvalConfig(output_dir=str(tmp_path / "out"), progress=False)
    result = run_suite(ScriptedEngine({}, default="<point>0.5, 0.5</point>"), load_suite(folder), cfg)
    assert result.tasks[0].field_errors == 1 and result.tasks[0].score == 0
    record = json.loads((tmp_path / "out" / "queries.jsonl").read_text().splitlines()[0])
    assert "bounding_boxes" in record["field_errors"]["Answer"]


def test_a_ground_truth_oracle_scores_full_marks_on_the_builtin_suite(tmp_path):
    """MEGA-Bench's sanity check: responses written from the references must score 1 everywhere
    (so the built-in tasks' parsers and metrics agree with their answers)."""
    suite = load_suite(write_builtin_suite(tmp_path, queries_per_task=3))
    answers = {}
    for task in suite.tasks:
        for q in task.queries:
            key = f"{task.name}/{q.idx}"
            if task.metric_info.response_parse_function == "json":
                answers[key] = "The bars: " + json.dumps({k: int(v) for k, v in q.answer.items()})
            elif task.metric_info.field_score_function["Answer"] == "boxed_single_numerical_match":
                answers[key] = f"The answer is \\boxed{{{q.answer['Answer']}}}"
            else:
                answers[key] = f"Let me look.\nAnswer: {q.answer['Answer']}"
    result = run_suite(ScriptedEngine(answers), suite, EvalConfig(progress=False))
    assert {t.name: t.score for t in result.tasks} == {name: 1.0 for name in BUILTIN_TASKS}


def test_a_corrupt_image_skips_its_query(tmp_path):
    folder = _write_suite(tmp_path / "suite")
    (folder / "corrupt.png").write_bytes(b"not a png")
    task = json.loads((folder / "colour.json").read_text())
    task["query_response"][1]["query_media"] = ["corrupt.png"]
    (folder / "colour.json").write_text(json.dumps(task))
    result = run_suite(
        ScriptedEngine(ANSWERS), load_suite(folder), EvalConfig(progress=False, tasks=("colour",))
    )
    (colour,) = result.tasks
    assert colour.skipped == {"unreadable_media": 1} and colour.num_scored == 1 and colour.score == 1.0


def test_evaluate_suite_returns_eval_suite_metrics(tmp_path):
    folder = _write_suite(tmp_path / "suite")
    engine = ScriptedEngine(ANSWERS)
    metrics = evaluate_suite(engine, folder, max_queries=1)
    assert metrics["eval_suite/task/colour"] == 1.0  # only colour/0 (max 1 query per task)
    # colour/0 1, lost/0 1, pair/0 0.5 (MEGA-Bench: the JSON int 1 scores 0 on positive_int_match)
    assert metrics["eval_suite/core"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert metrics["eval_suite/queries"] == 3 and metrics["eval_suite/skipped"] == 2
    assert "eval_suite/open" not in metrics
    assert not (folder / "queries.jsonl").exists()  # nothing written: the trainer's model changes


def test_cli_errors_name_the_file_and_task(tmp_path, capsys):
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "bad.json").write_text(
        json.dumps({"task_name": "oops", "query_response": [], "metric_info": {}})
    )
    code = run_eval_command(_parse(["--suite", str(folder), "--model", str(tmp_path / "none")]))
    err = capsys.readouterr().err
    assert code == 2 and "bad.json" in err and "'oops'" in err
    assert run_eval_command(_parse([])) == 2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    spec = TinyVLMSpec()
    build_tiny_vlm(spec, seed=0).save_pretrained(folder)
    build_processor(spec).save_pretrained(folder)
    return folder


def test_tiny_model_on_the_builtin_suite_writes_outputs_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    suite = write_builtin_suite(tmp_path / "builtin", queries_per_task=2)
    calls = []
    real_generate = HFRolloutEngine.generate

    def counting(self, samples, params, on_response=None):
        calls.append(len(samples))
        return real_generate(self, samples, params, on_response)

    monkeypatch.setattr(HFRolloutEngine, "generate", counting)
    out = tmp_path / "out"
    argv = ["--suite", str(suite), "--model", str(tiny_model_dir), "--output", str(out)]
    argv += ["--max-queries", "1", "--max-new-tokens", "4", "--batch-size", "16", "--no-progress"]
    assert run_eval_command(_parse(argv)) == 0
    assert calls == [len(BUILTIN_TASKS)]  # one query per task, one batch
    results = json.loads((out / "results.json").read_text())
    assert {t["name"] for t in results["tasks"]} == set(BUILTIN_TASKS)
    assert results["summary"]["num_queries"] == len(BUILTIN_TASKS)
    assert 0 <= results["summary"]["overall"] <= 1
    assert "| task | type | score |" in (out / "results.md").read_text()
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = (out / "queries.jsonl").read_bytes()
    assert len(records.splitlines()) == len(BUILTIN_TASKS)

    # Re-running resumes: nothing generated, nothing scored, no record rewritten.
    assert run_eval_command(_parse(argv)) == 0
    assert calls == [len(BUILTIN_TASKS)]
    assert (out / "queries.jsonl").read_bytes() == records
    assert json.loads((out / "results.json").read_text())["summary"] == results["summary"]
    assert json.loads((out / "results.json").read_text())["generated"] == 0


def test_the_command_module_turns_arguments_into_the_config():
    from mmrl.eval.command import config_from_args

    args = _parse(["--model", "m", "--max-queries", "3", "--tasks", "a", "b", "--pass-k", "4"])
    cfg = config_from_args(args)
    assert cfg.max_queries == 3 and cfg.tasks == ("a", "b") and cfg.pass_k == 4 and cfg.output_dir == "eval-m"


def test_mmrl_eval_names_metrics_skipped_for_a_missing_package_on_the_console(tmp_path, monkeypatch, capsys):
    """The install hint of a metric whose package is missing used to be only in results.json."""
    import mmrl.eval.command as command
    import mmrl.eval.runner as runner
    from mmrl.cli import build_parser

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "suite").mkdir()
    error = "needs the rapidfuzz package (pip install 'mmrl[megabench]')"
    result = runner.EvalResult(
        summary={"overall": 0.5, "core": 0.5, "open": None, "num_tasks": {"core": 1, "open": 0}, "num_queries": 3,
                 "skipped": {"unavailable_metric": 2}},
        tasks=[],
        breakdown={},
        skipped_queries=[{"task": "t", "query_idx": i, "reason": "unavailable_metric", "error": error} for i in (0, 1)],
    )  # fmt: skip
    monkeypatch.setattr(command, "load_suite", lambda *a, **k: None)
    monkeypatch.setattr(command, "run_suite", lambda *a, **k: result)
    args = build_parser("eval").parse_args(
        [
            "eval",
            "--model",
            str(tmp_path / "model"),
            "--suite",
            str(tmp_path / "suite"),
            "--output",
            str(tmp_path / "o"),
        ]
    )
    assert command.run_eval_command(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"2 queries skipped: {error}"


def test_mmrl_eval_with_tools_runs_trajectories_and_reports_turn_and_tool_figures(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """`--tools`: each query is a multi-turn trajectory through the training loop (here every turn
    reads as a zoom_in call, `eval_always_zoom`, so the tool really runs each turn), scored on
    its last turn; results, records and the console carry the same turn and tool figures as the
    trainer's `agent/*` metrics, and a re-run resumes without generating."""
    import mmrl.models.loading as loading
    from mmrl.environments import ParsedTurn, ToolCall, call_format_names, register_call_format
    from tests.conftest import bias_stop_token

    # (its own name: tests/plugins/multiturn_formats.py's may be imported under another module
    # name by a Ray test in the same process, and a name registers once)
    if "eval_always_zoom" not in call_format_names():
        register_call_format("eval_always_zoom")(
            lambda text: ParsedTurn([ToolCall("zoom_in", {"bbox_2d": [0, 0, 32, 32]}, text)], [], [])
        )

    # The saved tiny model, its LM head biased to its stop token, so that greedy turns end on it
    # (a random model's turns run to the length limit, and a cut turn ends its trajectory).
    real_load = loading.load_inference_policy

    def load_biased(path, *args, **kwargs):
        return bias_stop_token(real_load(path, *args, **kwargs), 50.0)

    monkeypatch.setattr(loading, "load_inference_policy", load_biased)
    suite = write_builtin_suite(tmp_path / "builtin", queries_per_task=2)
    out = tmp_path / "out"
    argv = ["--suite", str(suite), "--model", str(tiny_model_dir), "--output", str(out)]
    argv += ["--max-queries", "1", "--max-new-tokens", "4", "--batch-size", "16", "--no-progress"]
    argv += ["--tools", "zoom_in", "--call-format", "eval_always_zoom", "--max-turns", "3"]
    assert run_eval_command(_parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "tools zoom_in: 3.00 turns and 2.00 calls per query, tool-call rate 100.0%" in printed
    results = json.loads((out / "results.json").read_text())
    agent = results["summary"]["agent"]
    # Every trajectory: 3 turns, the calls of turns 1 and 2 run (the last turn's is not), ended
    # on max_turns; each zoom's crop came back as tokens.
    assert agent["turns"] == 3 and agent["tool_calls"] == 2 and agent["tool_call_rate"] == 1
    assert agent["end_max_turns"] == 1 and agent["end_answer"] == 0 and agent["tool_error_rate"] == 0
    assert agent["observation_tokens"] > 0
    assert all(t["agent"]["turns"] == 3 for t in results["tasks"])
    records = [json.loads(line) for line in (out / "queries.jsonl").read_text().splitlines()]
    assert len(records) == len(BUILTIN_TASKS)
    assert all(r["agent"]["termination"] == "max_turns" and r["agent"]["tool_calls"] == 2 for r in records)
    assert "## Tool use (zoom_in)" in (out / "results.md").read_text()
    # A re-run resumes from the records: nothing generated, the same figures.
    assert run_eval_command(_parse(argv)) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["generated"] == 0 and again["summary"]["agent"] == agent


def test_mmrl_eval_refuses_an_unknown_tool_or_call_format_before_loading_the_model(tmp_path, capsys):
    suite = _write_suite(tmp_path / "suite")
    argv = ["--suite", str(suite), "--model", str(tmp_path / "no-model"), "--output", str(tmp_path / "o")]
    argv += ["--tools", "zoom_in", "no_such_tool", "--call-format", "no_such_format", "--no-progress"]
    assert run_eval_command(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert "unknown tool 'no_such_tool'" in err and "unknown call format 'no_such_format'" in err
