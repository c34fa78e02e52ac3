"""The built-in mini-suite: mmrl's procedural kinds as MEGA-Bench tasks, written to a folder.

`mmrl eval` without `--suite` evaluates it. Nine tasks, Core (rule-scored) all:

| task | answer | parser | metric |
|---|---|---|---|
| `colour_code`, `count`, `arithmetic`, `bar_chart` | `\\boxed{n}` as mmrl trains | answer_string | boxed_single_numerical_match |
| `bar_chart_values` | `{"A": a, "B": b, "C": c}` (three fields) | json | exact_str_match per field, mean |
| `counting` | `Answer: n` (with a demonstration) | answer_string | positive_int_match |
| `ocr` | `Answer: word` (with a demonstration) | answer_string | normalized_similarity_damerau_levenshtein |
| `detection` | `Answer: [[x1, y1, x2, y2], ...]` in 0-1 | answer_string | nbbox_iou_tuple |
| `grounding` | `Answer: [x1, y1, x2, y2]` in 0-1 | answer_string | nbbox_iou_single |

The vision-reasoning tasks ask exactly what the training task asks (so a trained checkpoint is
evaluated in distribution); the perception tasks use MEGA-Bench's `Answer:` convention with a
one-shot demonstration drawn from the validation split. Queries come from the `heldout` split.

Its numbers are scored like any suite's: by default with MEGA-Bench's own definitions
(`--scoring megabench`; note that the JSON parser hands `bar_chart_values` integers, which
`exact_str_match` compares as text, and that `boxed_single_numerical_match` reads the *first*
box), or with `--scoring corrected`; every result records which (`summary["scoring"]`, the
first lines of `results.md`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mmrl.datasets.procedural import make_samples
from mmrl.eval.suite import write_task
from mmrl.types import Sample

ANSWER_INSTRUCTION = (
    "Answer the new question below. The last part of your response should be of the following format: "
    '"Answer: <YOUR ANSWER>" (without angle brackets) where YOUR ANSWER is your answer, following the '
    "same task logic and output format of the demonstration example(s)."
)
"""MEGA-Bench's closing instruction after a demonstration."""

_NUMERIC = ("colour_code", "count", "arithmetic", "bar_chart")
BUILTIN_TASKS = (*_NUMERIC, "bar_chart_values", "counting", "ocr", "detection", "grounding")
"""The built-in tasks, in order."""

_META = {
    "colour_code": (
        ["Object Recognition and Classification"],
        "Synthetic Images",
        "numerical_data",
        "Perception",
    ),
    "count": (
        ["Counting", "Object Recognition and Classification"],
        "Synthetic Images",
        "numerical_data",
        "Perception",
    ),
    "arithmetic": (
        ["Text Recognition (OCR)", "Mathematical and Logical Reasoning"],
        "Synthetic Images",
        "numerical_data",
        "Mathematics",
    ),
    "bar_chart": (
        ["Chart Understanding"],
        "Diagrams and Data Visualizations",
        "numerical_data",
        "Information_Extraction",
    ),
    "bar_chart_values": (
        ["Chart Understanding"],
        "Diagrams and Data Visualizations",
        "structured_output",
        "Information_Extraction",
    ),
    "counting": (["Counting"], "Synthetic Images", "numerical_data", "Perception"),
    "ocr": (["Text Recognition (OCR)"], "Text-Based Images and Documents", "exact_text", "Perception"),
    "detection": (["Object Localization"], "Synthetic Images", "structured_output", "Perception"),
    "grounding": (
        ["Object Localization", "Language Understanding"],
        "Synthetic Images",
        "structured_output",
        "Perception",
    ),
}


def _box01(box: list[int], size: int) -> list[float]:
    return [round(c / size, 3) for c in box]


def _query(task: str, sample: Sample, size: int) -> tuple[str, dict[str, Any]]:
    """The query text (with its `<image>`) and the reference answer fields of one sample."""
    gt = sample.reward_model.ground_truth
    if task in _NUMERIC:
        return sample.prompt[0]["content"], {"Answer": str(gt)}
    if task == "bar_chart_values":
        values = sample.extra_info["values"]
        text = (
            "<image>What are the values of bars A, B and C? Answer with a JSON object "
            '{"A": a, "B": b, "C": c}.'
        )
        return text, {label: str(v) for label, v in zip("ABC", values)}
    if task == "counting":
        return "<image>How many shapes are there?", {"Answer": str(gt)}
    if task == "ocr":
        return "<image>What word is written in the image?", {"Answer": str(gt)}
    if task == "detection":
        boxes = [_box01(b["bbox_2d"], size) for b in gt]
        return "<image>Give the box of every shape.", {"Answer": json.dumps(boxes)}
    if task == "grounding":
        colour = gt[0]["label"]
        return f"<image>Give the box of the {colour} shape.", {
            "Answer": json.dumps(_box01(gt[0]["bbox_2d"], size))
        }
    raise KeyError(task)


def _metric_info(task: str) -> dict[str, Any]:
    if task == "bar_chart_values":
        fields = {f: "exact_str_match" for f in "ABC"}
        return {
            "field_score_function": fields,
            "aggregation": {"function": "mean", "field_weights": {f: 1 for f in fields}},
            "response_parse_function": "json",
        }
    metric = {
        "counting": "positive_int_match",
        "ocr": "normalized_similarity_damerau_levenshtein",
        "detection": "nbbox_iou_tuple",
        "grounding": "nbbox_iou_single",
    }.get(task, "boxed_single_numerical_match")
    return {
        "field_score_function": {"Answer": metric},
        "aggregation": {"function": "mean", "field_weights": {"Answer": 1}},
        "response_parse_function": "answer_string",
    }


_DESCRIPTIONS = {
    "counting": "Count the shapes in the image.",
    "ocr": "Read the word written in the image.",
    "detection": "Locate every shape. Boxes are [x1, y1, x2, y2] with coordinates normalised to 0-1.",
    "grounding": "Locate the shape of the named colour. A box is [x1, y1, x2, y2] normalised to 0-1.",
}


def _kind(task: str) -> str:
    return "bar_chart" if task == "bar_chart_values" else task


def write_builtin_suite(
    folder: str | Path,
    queries_per_task: int = 8,
    seed: int = 0,
    image_size: int = 64,
    tasks: tuple[str, ...] = BUILTIN_TASKS,
) -> Path:
    """Write the mini-suite (one `<task>.json` each, images under `images/<task>/`) to `folder`."""
    folder = Path(folder)
    unknown = [t for t in tasks if t not in BUILTIN_TASKS]
    if unknown:
        raise ValueError(f"unknown built-in task(s) {unknown}: choose from {list(BUILTIN_TASKS)}")
    for task in tasks:
        images = folder / "images" / task
        images.mkdir(parents=True, exist_ok=True)
        samples = make_samples([_kind(task)], queries_per_task, "heldout", seed=seed, image_size=image_size)
        queries = []
        for i, sample in enumerate(samples):
            sample.pil_images()[0].save(images / f"{i}.png")
            text, answer = _query(task, sample, image_size)
            queries.append(
                {
                    "query_idx": i,
                    "query_text": text,
                    "query_media": [f"images/{task}/{i}.png"],
                    "correct_answer": answer,
                    "eval_context": {},
                }
            )
        example_text, example_media = "", []
        if task in _DESCRIPTIONS:
            demo = make_samples([_kind(task)], 1, "validation", seed=seed, image_size=image_size)[0]
            demo.pil_images()[0].save(images / "demo.png")
            demo_text, demo_answer = _query(task, demo, image_size)
            example_text = (
                "Demonstration example(s) of the task:\nExample 1:\n<image>\n"
                f"Example Question: {demo_text.replace('<image>', '')}\n"
                f"Example Response:\nAnswer: {demo_answer['Answer']}\n\n{ANSWER_INSTRUCTION}"
            )
            example_media = [f"images/{task}/demo.png"]
        skills, input_format, output_format, app = _META[task]
        write_task(
            {
                "task_name": task,
                "task_description": _DESCRIPTIONS.get(task, ""),
                "global_media": [],
                "example_text": example_text,
                "example_media": example_media,
                "query_response": queries,
                "metric_info": _metric_info(task),
                "metadata": {
                    "skills": skills,
                    "input_format": input_format,
                    "output_format": output_format,
                    "app": app,
                    "num_input": "1-image",
                },
            },
            folder / f"{task}.json",
        )
    return folder


def builtin_suite_path(
    queries_per_task: int = 8, seed: int = 0, image_size: int = 64, cache_dir: str | None = None
) -> Path:
    """The built-in suite, written once under `$MMRL_CACHE/eval/` (keyed by its arguments)."""
    root = Path(cache_dir or os.environ.get("MMRL_CACHE") or Path.home() / ".cache" / "mmrl") / "eval"
    key = hashlib.sha1(
        json.dumps([1, BUILTIN_TASKS, queries_per_task, seed, image_size]).encode()
    ).hexdigest()[:12]
    target = root / f"builtin-{key}"
    if (target / f"{BUILTIN_TASKS[-1]}.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="builtin-", dir=root))
    try:
        write_builtin_suite(tmp, queries_per_task, seed, image_size)
        try:
            tmp.rename(target)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
