"""Sample records: validated on load, with errors naming file, line, id and field."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from mmrl.datasets import SampleError, read_samples
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import write_jsonl, write_parquet


def _png(colour=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def _record(**changes) -> dict:
    record = {
        "data_source": "toy",
        "prompt": [{"role": "user", "content": "<image>What is 1+2?"}],
        "images": ["data:image/png;base64," + base64.b64encode(_png()).decode()],
        "ability": "math",
        "reward_model": {"ground_truth": "3", "verifier": "math", "accuracy_ratio": 1.0, "format_ratio": 0.0},
        "extra_info": {"id": "toy-1"},
    }
    record.update(changes)
    return record


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_valid_records_load_with_images_as_base64_path_and_bytes_object(tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    records = [
        _record(),
        _record(images=["red.png"], extra_info={"id": "toy-2"}),  # relative to the file
        _record(images=[{"bytes": None, "path": str(tmp_path / "red.png")}], extra_info={"id": "toy-3"}),
    ]
    samples = read_samples(_write(tmp_path, records))
    assert [s.id for s in samples] == ["toy-1", "toy-2", "toy-3"]
    for s in samples:
        assert s.pil_images()[0].getpixel((0, 0)) == (255, 0, 0)
        assert s.chat_messages()[0]["content"] == [
            {"type": "image"},
            {"type": "text", "text": "What is 1+2?"},
        ]


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"data_source": None}, "data_source", "missing"),
        ({"reward_model": {"verifier": "math"}}, "reward_model.ground_truth", "missing"),
        (
            {"reward_model": {"ground_truth": "3", "verifier": "nope"}},
            "reward_model.verifier",
            "unknown verifier 'nope'",
        ),
        (
            {"reward_model": {"ground_truth": "3", "verifier": "math", "format_ratio": 2}},
            "reward_model.format_ratio",
            "in [0, 1]",
        ),
        (
            {"reward_model": {"ground_truth": "3", "verifier": "math", "verifier_params": "{oops"}},
            "reward_model.verifier_params",
            "not valid JSON",
        ),
        ({"images": ["missing.png"]}, "images[0]", "not found"),
        (
            {"images": ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]},
            "images[0]",
            "unreadable or truncated image",
        ),
        ({"images": []}, "prompt", "1 '<image>' placeholder(s) but the record has 0 image(s)"),
        ({"prompt": [{"role": "robot", "content": "hi"}]}, "prompt[0].role", "system/user/assistant"),
    ],
)
def test_a_bad_record_names_file_line_id_and_field(tmp_path, change, field, problem):
    path = _write(tmp_path, [_record(extra_info={"id": "good"}), _record(**change)])
    with pytest.raises(SampleError) as info:
        read_samples(path)
    message = str(info.value)
    assert f"{path}:2" in message
    assert "(id=toy-1)" in message
    assert f"field '{field}'" in message
    assert problem in message


def test_an_image_too_elongated_for_the_processor_names_file_line_and_field(tmp_path):
    """Issue 48, item 19: Qwen2-VL's processor refuses an aspect ratio over 200:1 mid-step,
    naming nothing; data loading refuses it first, naming the record."""
    Image.new("RGB", (402, 2)).save(tmp_path / "strip.png")
    Image.new("RGB", (2, 400)).save(tmp_path / "ok.png")  # 200:1 is still taken
    path = _write(
        tmp_path, [_record(images=["ok.png"], extra_info={"id": "ok"}), _record(images=["strip.png"])]
    )
    with pytest.raises(SampleError) as info:
        read_samples(path)
    message = str(info.value)
    assert f"{path}:2 (id=toy-1): field 'images[0]'" in message
    assert "strip.png: 402x2 pixels, an aspect ratio of 201:1, more than the 200:1" in message


def test_missing_id_and_duplicate_ids_are_errors(tmp_path):
    with pytest.raises(SampleError, match=r"data.jsonl:1: field 'extra_info.id': missing"):
        read_samples(_write(tmp_path, [_record(extra_info={})]))
    with pytest.raises(SampleError, match=r"duplicate id \(also record 1\)"):
        read_samples(_write(tmp_path, [_record(), _record()]))


def test_invalid_json_line_is_reported_with_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_record()) + "\n{not json\n")
    with pytest.raises(SampleError, match=r"data.jsonl:2: field '<record>': invalid JSON"):
        read_samples(path)


def test_a_math_ground_truth_that_cannot_be_parsed_fails_at_load_time(tmp_path):
    bad = _record(reward_model={"ground_truth": "", "verifier": "math"})
    with pytest.raises(SampleError, match="reward_model.ground_truth"):
        read_samples(_write(tmp_path, [bad]))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_procedural_samples_round_trip_through_files(tmp_path, fmt):
    samples = make_samples(["colour_code", "count"], 6, "train", seed=3)
    path = tmp_path / f"samples.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(samples, path)
    loaded = read_samples(path)
    assert [s.id for s in loaded] == [s.id for s in samples]
    for a, b in zip(samples, loaded):
        assert a.reward_model.ground_truth == b.reward_model.ground_truth
        assert a.prompt == b.prompt
        assert a.pil_images()[0].tobytes() == b.pil_images()[0].tobytes()


def test_parquet_row_errors_name_the_row(tmp_path):
    samples = make_samples(["colour_code"], 2, "train")
    path = tmp_path / "s.parquet"
    write_parquet(samples, path)
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    table[1]["reward_model"]["verifier"] = "unknown_verifier"
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), path)
    with pytest.raises(
        SampleError,
        match=r"s.parquet row 1 \(id=vision_reasoning/colour_code/train/0/1\): field 'reward_model.verifier'",
    ):
        read_samples(path)
