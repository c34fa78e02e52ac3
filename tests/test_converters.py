"""Converters from COCO, V-Triune and EasyR1/veRL data to validated mmrl samples."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrl.datasets import SampleError, read_samples, sample_from_record
from mmrl.datasets.converters import (
    CONVERTERS,
    coco_to_samples,
    convert,
    easyr1_to_samples,
    map_verifier_names,
    vtriune_record,
    vtriune_to_samples,
)
from mmrl.verifiers import get_verifier


def _png_bytes(size=(8, 8), colour=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------------------------------------
# COCO

# Image 1 has a person, two cars and a crowd of dogs; image 2 has one dog.
COCO_ANNOTATIONS = {
    "images": [
        {"id": 1, "file_name": "a.png", "width": 64, "height": 48},
        {"id": 2, "file_name": "b.png", "width": 32, "height": 32},
    ],
    "categories": [
        {"id": 1, "name": "person"},
        {"id": 2, "name": "car"},
        {"id": 3, "name": "dog"},
    ],
    "annotations": [
        {"id": 10, "image_id": 1, "category_id": 1, "bbox": [1.5, 2.25, 10, 20.5], "iscrowd": 0},
        {"id": 11, "image_id": 1, "category_id": 2, "bbox": [30, 5, 12, 8], "iscrowd": 0},
        {"id": 12, "image_id": 1, "category_id": 2, "bbox": [40, 20, 10, 10], "iscrowd": 0},
        {"id": 13, "image_id": 1, "category_id": 3, "bbox": [0, 30, 20, 15], "iscrowd": 1},
        {"id": 20, "image_id": 2, "category_id": 3, "bbox": [4, 4, 8, 8], "iscrowd": 0},
    ],
}
PERSON = {"bbox_2d": [1.5, 2.25, 11.5, 22.75], "label": "person"}  # [x, y, x + w, y + h]
CAR_1 = {"bbox_2d": [30, 5, 42, 13], "label": "car"}
CAR_2 = {"bbox_2d": [40, 20, 50, 30], "label": "car"}
CROWD_DOG = {"bbox_2d": [0, 30, 20, 45], "label": "dog"}
DOG = {"bbox_2d": [4, 4, 12, 12], "label": "dog"}


@pytest.fixture()
def coco(tmp_path):
    """(annotation file, image folder) of a two-image COCO set."""
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    (image_dir / "a.png").write_bytes(_png_bytes((64, 48), (0, 255, 0)))
    (image_dir / "b.png").write_bytes(_png_bytes((32, 32), (0, 0, 255)))
    annotation_file = tmp_path / "instances.json"
    annotation_file.write_text(json.dumps(COCO_ANNOTATIONS))
    return annotation_file, image_dir


def test_coco_detection_has_one_sample_per_image_with_corner_boxes_and_category_labels(coco):
    annotation_file, image_dir = coco
    samples = coco_to_samples(annotation_file, image_dir)

    assert [s.id for s in samples] == ["coco/1", "coco/2"]
    first, second = samples
    assert first.data_source == "coco"
    assert first.ability == "detection"
    assert first.images == [str(image_dir / "a.png")]
    assert first.pil_images()[0].size == (64, 48)
    assert first.pil_images()[0].getpixel((0, 0)) == (0, 255, 0)
    # The crowd annotation is left out; the question names the categories present, by id order.
    assert first.reward_model.ground_truth == [PERSON, CAR_1, CAR_2]
    assert first.prompt == [
        {
            "role": "user",
            "content": "<image>Detect all objects of the following categories in the image: person, car. "
            'Answer with a JSON list with one entry per object, {"bbox_2d": [x1, y1, x2, y2], '
            '"label": "<category>"}, where (x1, y1) is the top-left and (x2, y2) the bottom-right '
            "corner in pixels.",
        }
    ]
    assert first.reward_model.verifier == "detection"
    assert first.reward_model.verifier_params == {"iou_threshold": "dynamic"}
    assert (first.reward_model.accuracy_ratio, first.reward_model.format_ratio) == (1.0, 0.0)
    assert first.extra_info == {"id": "coco/1", "image_id": 1, "width": 64, "height": 48}
    assert second.reward_model.ground_truth == [DOG]
    assert "categories in the image: dog." in second.prompt[0]["content"]


def test_coco_detection_options(coco, caplog):
    annotation_file, image_dir = coco
    with_crowd = coco_to_samples(annotation_file, image_dir, skip_crowd=False, data_source="coco-val")
    assert with_crowd[0].id == "coco-val/1"
    assert with_crowd[0].reward_model.ground_truth == [PERSON, CAR_1, CAR_2, CROWD_DOG]
    assert "person, car, dog." in with_crowd[0].prompt[0]["content"]

    renamed = coco_to_samples(
        annotation_file, image_dir, category_names={1: "pedestrian"}, question="Find: {categories}"
    )
    assert renamed[0].reward_model.ground_truth[0]["label"] == "pedestrian"
    assert renamed[0].prompt[0]["content"] == "<image>Find: pedestrian, car"

    # Images with more boxes than max_boxes are skipped, and the count is logged.
    with caplog.at_level(logging.WARNING, logger="mmrl.datasets.converters"):
        capped = coco_to_samples(annotation_file, image_dir, max_boxes=2)
    assert [s.id for s in capped] == ["coco/2"]
    assert "skipped 1 images with more than max_boxes=2 boxes" in caplog.text


def test_coco_grounding_uses_only_categories_that_occur_once_in_the_image(coco):
    annotation_file, image_dir = coco
    samples = coco_to_samples(annotation_file, image_dir, task="grounding")
    # Image 1: the person (the cars are two, the dogs only a crowd); image 2: the dog.
    assert [s.id for s in samples] == ["coco/1/10", "coco/2/20"]
    person, dog = samples
    assert person.ability == "grounding"
    assert person.reward_model.ground_truth == [PERSON]
    assert person.prompt[0]["content"] == (
        '<image>Locate the person in the image. Answer with a JSON list holding its box, [{"bbox_2d": '
        '[x1, y1, x2, y2], "label": "person"}], where (x1, y1) is the top-left and (x2, y2) the '
        "bottom-right corner in pixels."
    )
    assert person.extra_info == {
        "id": "coco/1/10",
        "image_id": 1,
        "annotation_id": 10,
        "width": 64,
        "height": 48,
    }
    assert dog.reward_model.ground_truth == [DOG]
    assert dog.images == [str(image_dir / "b.png")]


def test_coco_grounding_counts_crowd_annotations_when_deciding_uniqueness(coco):
    annotation_file, image_dir = coco
    data = json.loads(annotation_file.read_text())
    data["annotations"].append(
        {"id": 14, "image_id": 1, "category_id": 1, "bbox": [50, 0, 10, 10], "iscrowd": 1}
    )
    annotation_file.write_text(json.dumps(data))
    samples = coco_to_samples(annotation_file, image_dir, task="grounding")
    assert [s.id for s in samples] == ["coco/2/20"]  # "the person" is ambiguous next to a crowd


def test_converted_coco_samples_score_a_perfect_answer_as_1(coco):
    annotation_file, image_dir = coco
    verifier = get_verifier("detection")
    for task in ("detection", "grounding"):
        for sample in coco_to_samples(annotation_file, image_dir, task=task):
            answer = "<answer>" + json.dumps(sample.reward_model.ground_truth) + "</answer>"
            result = verifier(answer, sample)
            assert result.error is None
            assert result.score == pytest.approx(1.0), (task, sample.id, result.components)


def test_coco_missing_image_file_is_an_error_naming_the_file(coco):
    annotation_file, image_dir = coco
    (image_dir / "b.png").unlink()
    with pytest.raises(SampleError) as info:
        coco_to_samples(annotation_file, image_dir)
    message = str(info.value)
    assert f"{annotation_file} image 2 (id=coco/2)" in message
    assert "field 'images[0]'" in message
    assert f"{image_dir / 'b.png'}: image file not found" in message
    # Without image checks the sample is still made (e.g. images copied in later).
    assert len(coco_to_samples(annotation_file, image_dir, check_images=False)) == 2


@pytest.mark.parametrize(
    ("change", "where", "field", "problem"),
    [
        ({"bbox": [1, 2, 3]}, "annotation 20 (image 2)", "bbox", "4 numbers"),
        ({"bbox": [1, 2, 0, 3]}, "annotation 20 (image 2)", "bbox", "must be positive"),
        ({"category_id": 99}, "annotation 20 (image 2)", "category_id", "unknown category id 99"),
        ({"image_id": 7}, "annotation 20", "image_id", "no image with id 7"),
    ],
)
def test_coco_bad_annotation_is_an_error_naming_it(coco, change, where, field, problem):
    annotation_file, image_dir = coco
    data = json.loads(annotation_file.read_text())
    data["annotations"][-1].update(change)
    annotation_file.write_text(json.dumps(data))
    with pytest.raises(SampleError) as info:
        coco_to_samples(annotation_file, image_dir)
    message = str(info.value)
    assert f"{annotation_file} {where}" in message
    assert f"field '{field}'" in message
    assert problem in message


# ---------------------------------------------------------------------------------------------
# V-Triune

DET_RATIO = {
    "iou_max_label_first": 1.0,
    "iou_max_iou_first": 0.0,
    "iou_completeness": 0.3,
    "map": 0.0,
    "map50": 0.0,
    "map75": 0.0,
}


def _vtriune_rows():
    return [
        {
            "data_source": "mathverse",
            "prompt": [{"role": "user", "content": "<image>What is x?"}],
            "images": [{"bytes": _png_bytes(colour=(255, 0, 0)), "path": None}],
            "ability": "math",
            "reward_model": {
                "ground_truth": "<answer> 3 </answer>",
                "answer": "3",
                "verifier": "mathverify",
                "verifier_parm": json.dumps({"verifier_style": "rule"}),
                "accuracy_ratio": 1.0,
                "format_ratio": 0.2,
            },
            "extra_info": {"id": "mathverse-17", "image_path": None},
        },
        {
            "data_source": "v3det",
            "prompt": [{"role": "user", "content": "<image>Detect the dog."}],
            "images": [{"bytes": None, "path": "img/d.png"}],  # relative to the file
            "ability": "detection",
            "reward_model": {
                # V-Triune writes box lists as Python literals inside answer tags.
                "ground_truth": "<answer> [{'bbox_2d': [1, 2, 10, 12], 'label': 'dog'}] </answer>",
                "answer": None,
                "verifier": "detection",
                "verifier_parm": json.dumps(
                    {"det_verifier_normalized": False, "det_reward_ratio": DET_RATIO, "step": 3}
                ),
                "accuracy_ratio": None,  # missing ratios take the defaults 1.0 / 0.0
                "format_ratio": None,
            },
            "extra_info": {"id": None, "image_path": "img/d.png"},  # no id: data_source/index
        },
    ]


@pytest.fixture()
def vtriune_parquet(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "d.png").write_bytes(_png_bytes((16, 16), (0, 0, 255)))
    return _write_parquet(tmp_path / "vtriune.parquet", _vtriune_rows())


def test_vtriune_parquet_records_are_renamed_into_mmrl_spelling(vtriune_parquet):
    math, det = vtriune_to_samples(vtriune_parquet)

    assert math.id == "mathverse-17"
    assert math.reward_model.verifier == map_verifier_names["mathverify"] == "math"
    assert math.reward_model.ground_truth == "3"  # unwrapped from <answer> tags
    # verifier_parm (a JSON string) becomes verifier_params, minus V-Triune's runtime keys;
    # mathverify's format reward is the think/answer structure.
    assert math.reward_model.verifier_params == {"format": "think_answer"}
    assert (math.reward_model.accuracy_ratio, math.reward_model.format_ratio) == (1.0, 0.2)
    assert math.prompt == [{"role": "user", "content": "<image>What is x?"}]
    assert math.pil_images()[0].getpixel((0, 0)) == (255, 0, 0)
    assert math.extra_info == {
        "id": "mathverse-17",
        "image_path": None,
        "source_file": str(vtriune_parquet),
        "answer": "3",
    }

    assert det.id == "v3det/1"
    assert det.extra_info["id"] == "v3det/1"
    assert det.extra_info["source_file"] == str(vtriune_parquet)
    assert det.reward_model.verifier == "detection"
    assert det.reward_model.ground_truth == [{"bbox_2d": [1, 2, 10, 12], "label": "dog"}]
    assert det.reward_model.verifier_params == {
        "normalized": False,
        "completeness_weight": 0.3,
        "weights": {k: v for k, v in DET_RATIO.items() if k != "iou_completeness"},
    }
    assert (det.reward_model.accuracy_ratio, det.reward_model.format_ratio) == (1.0, 0.0)
    assert det.pil_images()[0].size == (16, 16)
    assert get_verifier("detection")("[{'bbox_2d': [1, 2, 10, 12], 'label': 'dog'}]", det).score == 1.0


def test_vtriune_jsonl_with_missing_ratios_and_nested_json_strings(tmp_path):
    row = {
        "data_source": "geoqa",
        "prompt": json.dumps([{"role": "user", "content": "<image>Angle?"}]),
        "images": [{"bytes": None, "path": str(tmp_path / "g.png")}],
        "reward_model": json.dumps({"ground_truth": "45", "verifier": "mathverify"}),
        "extra_info": json.dumps({"split": "train"}),
    }
    (tmp_path / "g.png").write_bytes(_png_bytes())
    (sample,) = vtriune_to_samples(_write_jsonl(tmp_path / "v.jsonl", [row]))
    assert sample.id == "geoqa/0"
    assert sample.extra_info == {"split": "train", "id": "geoqa/0", "source_file": str(tmp_path / "v.jsonl")}
    assert sample.prompt == [{"role": "user", "content": "<image>Angle?"}]
    assert sample.reward_model.ground_truth == "45"
    assert (sample.reward_model.accuracy_ratio, sample.reward_model.format_ratio) == (1.0, 0.0)


def test_vtriune_record_accepts_numpy_arrays_as_pandas_reads_parquet():
    row = _vtriune_rows()[0]
    row["prompt"] = np.array(row["prompt"], dtype=object)
    row["images"] = np.array(row["images"], dtype=object)
    record = vtriune_record(row, 0, where="rows.parquet row 0")
    assert record["prompt"] == [{"role": "user", "content": "<image>What is x?"}]
    sample = sample_from_record(record, "rows.parquet row 0")
    assert sample.reward_model.verifier == "math"
    assert sample.pil_images()[0].size == (8, 8)


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"verifier": "vtriune_only"}, "reward_model.verifier", "unknown verifier 'vtriune_only'"),
        ({"verifier_parm": "{oops"}, "reward_model.verifier_parm", "not valid JSON"),
        ({"verifier_parm": '{"iou_threshold": 2}'}, "reward_model.verifier_parm.iou_threshold", "[0, 1]"),
        ({"verifier_parm": '{"nms": true}'}, "reward_model.verifier_parm.nms", "unknown detection parameter"),
        (
            {"verifier_parm": '{"det_verifier_normalized": true}'},
            "reward_model.verifier_parm.det_verifier_normalized",
            "image_size",
        ),
        ({"ground_truth": "<answer> no boxes </answer>"}, "reward_model.ground_truth", "no valid box"),
    ],
)
def test_vtriune_bad_record_names_the_row_and_their_field(vtriune_parquet, change, field, problem):
    rows = _vtriune_rows()
    rows[1]["reward_model"].update(change)
    _write_parquet(vtriune_parquet, rows)
    with pytest.raises(SampleError) as info:
        vtriune_to_samples(vtriune_parquet)
    message = str(info.value)
    assert f"{vtriune_parquet} row 1 (id=v3det/1)" in message
    assert f"field '{field}'" in message
    assert problem in message


# ---------------------------------------------------------------------------------------------
# EasyR1 / veRL


@pytest.fixture()
def easyr1_jsonl(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "e.png").write_bytes(_png_bytes((12, 10), (9, 9, 9)))
    rows = [
        {"problem": "<image>Find x.", "answer": "3", "images": ["pics/e.png"]},
        {
            "problem": "Compare <image> and <image>.",
            "answer": 2,
            "images": [{"bytes": None, "path": "pics/e.png"}, "pics/e.png"],
        },
        {"problem": "What is 2+2?", "answer": "4", "images": []},
    ]
    return _write_jsonl(tmp_path / "geo_easy.jsonl", rows)


def test_easyr1_rows_become_math_samples(easyr1_jsonl):
    samples = easyr1_to_samples(easyr1_jsonl)
    assert [s.id for s in samples] == ["geo_easy/0", "geo_easy/1", "geo_easy/2"]  # file stem
    first = samples[0]
    assert first.data_source == "geo_easy"
    assert first.prompt == [{"role": "user", "content": "<image>Find x."}]
    assert first.images == [str(easyr1_jsonl.parent / "pics" / "e.png")]
    assert first.pil_images()[0].size == (12, 10)
    assert first.ability == "math"
    assert first.reward_model.verifier == "math"
    assert first.reward_model.ground_truth == "3"
    assert first.extra_info == {"id": "geo_easy/0", "index": 0, "source_file": str(easyr1_jsonl)}
    assert samples[1].reward_model.ground_truth == "2"  # numbers become strings
    assert len(samples[1].pil_images()) == 2
    assert samples[2].images == []

    named = easyr1_to_samples(easyr1_jsonl, data_source="geo")
    assert [s.id for s in named][:1] == ["geo/0"]


def test_easyr1_custom_keys(tmp_path):
    (tmp_path / "q.png").write_bytes(_png_bytes())
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "<image>n?", "solution": "7", "image": "q.png"}])
    (sample,) = easyr1_to_samples(path, prompt_key="question", answer_key="solution", image_key="image")
    assert sample.prompt[0]["content"] == "<image>n?"
    assert sample.reward_model.ground_truth == "7"
    assert len(sample.pil_images()) == 1


def test_verl_geo3k_rows_keep_their_fields_and_take_ids_from_extra_info_index(tmp_path):
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": "<image>Find y. Put the answer in \\boxed{}."}],
            "images": [{"bytes": _png_bytes(colour=(1, 2, 3)), "path": None}],
            "ability": "math",
            "reward_model": {"ground_truth": "\\frac{4}{3}", "style": "rule"},
            "extra_info": {"split": "train", "index": 41, "answer": "\\frac{4}{3}", "question": "Find y."},
        }
    ]
    path = _write_parquet(tmp_path / "geo3k_train.parquet", rows)
    (sample,) = easyr1_to_samples(path)
    assert sample.id == "hiyouga/geometry3k/train/41"
    assert sample.data_source == "hiyouga/geometry3k"
    assert sample.prompt == rows[0]["prompt"]
    assert sample.pil_images()[0].getpixel((0, 0)) == (1, 2, 3)
    assert sample.reward_model.verifier == "math"  # style "rule"
    assert sample.reward_model.ground_truth == "\\frac{4}{3}"
    assert sample.extra_info == {**rows[0]["extra_info"], "id": sample.id, "source_file": str(path)}
    assert get_verifier("math")("\\boxed{4/3}", sample).score == 1.0

    del rows[0]["extra_info"]["index"], rows[0]["extra_info"]["split"]
    _write_parquet(path, rows)
    assert easyr1_to_samples(path)[0].id == "hiyouga/geometry3k/0"  # the row number


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        (
            {"problem": "<image><image>Compare.", "answer": "1", "images": ["pics/e.png"]},
            "problem",
            "has 2 '<image>' placeholder(s) but the record has 1 image(s)",
        ),
        (
            {"problem": "Compare.", "answer": "1", "images": ["pics/e.png"]},
            "problem",
            "has 0 '<image>' placeholder(s) but the record has 1 image(s)",
        ),
        ({"problem": "<image>x?", "answer": "1", "images": ["pics/none.png"]}, "images[0]", "not found"),
        ({"problem": "x?", "answer": ""}, "answer", "is empty"),
        ({"problem": "x?"}, "answer", "missing"),
        ({"question": "x?", "answer": "1"}, "<record>", "neither an EasyR1 row"),
        (
            {"data_source": "d", "prompt": "x?", "reward_model": {"ground_truth": "1", "style": "model"}},
            "reward_model.style",
            "only 'rule'",
        ),
    ],
)
def test_easyr1_bad_row_names_the_line_and_the_source_field(easyr1_jsonl, row, field, problem):
    rows = [json.loads(line) for line in easyr1_jsonl.read_text().splitlines()]
    _write_jsonl(easyr1_jsonl, [rows[0], row])
    with pytest.raises(SampleError) as info:
        easyr1_to_samples(easyr1_jsonl)
    message = str(info.value)
    assert f"{easyr1_jsonl}:2" in message
    assert f"field '{field}'" in message
    assert problem in message


# ---------------------------------------------------------------------------------------------
# convert


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_convert_round_trips_through_read_samples(coco, easyr1_jsonl, vtriune_parquet, tmp_path, suffix):
    annotation_file, image_dir = coco
    cases = [
        ("coco", (annotation_file, image_dir), {"task": "grounding"}),
        ("vtriune", (vtriune_parquet,), {}),
        ("easyr1", (easyr1_jsonl,), {"data_source": "geo"}),
    ]
    for kind, inputs, options in cases:
        output = tmp_path / "out" / f"{kind}{suffix}"
        converted = CONVERTERS[kind](*inputs, **options)
        assert convert(kind, *inputs, output_path=output, **options) == len(converted)
        loaded = read_samples(output)
        assert [s.id for s in loaded] == [s.id for s in converted]
        for a, b in zip(converted, loaded):
            gt = b.reward_model.ground_truth
            if isinstance(a.reward_model.ground_truth, list) and isinstance(gt, str):
                gt = json.loads(gt)  # Parquet stores box lists as JSON text
            assert gt == a.reward_model.ground_truth
            assert b.prompt == a.prompt
            assert b.reward_model.verifier_params == a.reward_model.verifier_params
            assert b.extra_info == a.extra_info
            assert [im.tobytes() for im in b.pil_images()] == [im.tobytes() for im in a.pil_images()]


def test_convert_concatenates_inputs_and_rejects_duplicate_ids_and_bad_arguments(easyr1_jsonl, tmp_path):
    out = tmp_path / "all.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_text(easyr1_jsonl.read_text())
    assert convert("easyr1", easyr1_jsonl, other, output_path=out) == 6
    with pytest.raises(SampleError, match=r"field 'extra_info.id': duplicate id"):
        convert("easyr1", easyr1_jsonl, easyr1_jsonl, output_path=tmp_path / "dup.jsonl")
    assert not (tmp_path / "dup.jsonl").exists()
    with pytest.raises(ValueError, match="unknown converter 'yolo'"):
        convert("yolo", easyr1_jsonl, output_path=out)
    with pytest.raises(ValueError, match=r"\.jsonl, \.json or \.parquet"):
        convert("easyr1", easyr1_jsonl, output_path=tmp_path / "out.csv")
    with pytest.raises(ValueError, match="two inputs"):
        convert("coco", easyr1_jsonl, output_path=out)
