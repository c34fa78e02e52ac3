"""Property-based fuzzing (hypothesis) of every parser that reads model output or user data.

A fixed budget and a fixed seed (`derandomize`) keep CI deterministic. A parser may reject its
input, but only with its own documented error, never crash or hang; a crash found here is fixed
and kept as an explicit regression case.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmrl.datasets.geneval import draw, parse_prompt
from mmrl.datasets.schema import SampleError, sample_from_record
from mmrl.eval.parsers import parse_answer_string, parse_json_value
from mmrl.server.protocol import RequestError, parse_get_reward, parse_judge, parse_score_request
from mmrl.types import ImageError, RewardSpec, Sample, VerifyContext, load_image
from mmrl.verifiers import get_verifier, verifier_names
from mmrl.verifiers.detection import parse_boxes
from mmrl.verifiers.math import extract_answer, last_boxed

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Text that looks like model output: braces, tags, quotes, LaTeX, JSON punctuation.
ATOMS = st.sampled_from(
    [
        "\\boxed{",
        "}",
        "{",
        "<answer>",
        "</answer>",
        "<think>",
        "\\frac",
        "[",
        "]",
        '"',
        "'",
        ",",
        ":",
        "bbox_2d",
        "label",
        "1",
        "-2.5",
        "\\",
        "\n",
        " ",
        "```",
        "json",
        "null",
        "9^{9}",
    ]
)
MODEL_TEXT = st.one_of(st.text(max_size=300), st.lists(ATOMS, max_size=60).map("".join))
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(MODEL_TEXT)
def test_answer_extraction_never_crashes(text):
    for value in (last_boxed(text), extract_answer(text)):
        assert value is None or isinstance(value, str)


@FUZZ
@given(st.text(alphabet=st.characters(blacklist_characters="{}\\"), max_size=50))
def test_a_boxed_answer_is_extracted_verbatim(inner):
    assert extract_answer(f"reasoning... \\boxed{{{inner}}} done") == inner.strip()


@FUZZ
@given(MODEL_TEXT)
def test_box_lists_parse_to_valid_boxes_or_none(text):
    boxes = parse_boxes(text)
    assert boxes is None or all(b.x1 <= b.x2 and b.y1 <= b.y2 for b in boxes)


@FUZZ
@given(MODEL_TEXT)
def test_eval_answer_parsers_never_crash(text):
    parsed = parse_answer_string(text, "answer")
    assert parsed is not None
    parse_json_value(text)


GENEVAL_SPEC = parse_prompt("a red circle")
GENEVAL_IMAGE = draw(GENEVAL_SPEC, np.random.default_rng(0), 32)


@FUZZ
@given(MODEL_TEXT, st.sampled_from(sorted(set(verifier_names()))))
def test_every_verifier_scores_any_response_without_raising(text, name):
    gold = {"detection": [{"bbox_2d": [1, 2, 30, 40], "label": "cat"}], "choice": "B", "counting": 3}.get(
        name, "3"
    )
    images = []
    if name == "geneval":  # scores the sample's image against its spec (the text is not read)
        gold, images = GENEVAL_SPEC.to_dict(), [GENEVAL_IMAGE]
    sample = Sample(
        "fuzz", [{"role": "user", "content": "q"}], images, "x", RewardSpec(gold, name), {"id": "f"}
    )
    result = get_verifier(name)(text, sample, VerifyContext(1, 10), time_limit_s=5.0)
    # Malformed model output is a (low) score, never a verifier error: an error here is a bug.
    assert result.error is None, result.error
    assert 0.0 <= result.score <= 1.0


@FUZZ
@given(JSONISH)
def test_sample_records_either_load_or_fail_with_a_sample_error(record):
    try:
        sample_from_record(record, "fuzz.jsonl:1", check_images=False)
    except SampleError as exc:
        assert "fuzz.jsonl:1" in str(exc)


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "data_source": JSONISH,
            "prompt": JSONISH,
            "reward_model": JSONISH,
            "extra_info": JSONISH,
            "images": JSONISH,
        },
    )
)
def test_records_with_the_right_keys_and_wrong_values_fail_cleanly(record):
    try:
        sample_from_record(record, "fuzz.jsonl:2", check_images=False)
    except SampleError:
        pass


@FUZZ
@given(JSONISH)
def test_server_payloads_are_accepted_or_rejected_with_a_4xx(payload):
    known = frozenset(verifier_names())
    for parse in (
        lambda d: parse_score_request(d, known, 64),
        lambda d: parse_get_reward(d, known, 64, "auto", "math"),
        lambda d: parse_judge(d, known, 0.1),
    ):
        try:
            parse(payload)
        except RequestError as exc:
            assert 400 <= exc.status < 500


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_as_an_image_give_an_image_error(data):
    try:
        load_image(data)
    except ImageError as exc:
        assert "bytes" in str(exc)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_truncated_images_are_rejected_with_a_clear_message():
    data = _png(Image.effect_noise((64, 64), 50).convert("RGB"))
    with pytest.raises(ImageError, match="unreadable or truncated image"):
        load_image(data[: len(data) // 2])


def test_huge_images_are_refused_before_decoding():
    data = _png(Image.new("L", (10_000, 10_000)))  # 100 megapixels, a few kB of PNG
    with pytest.raises(ImageError, match="10000x10000 pixels is more than the limit"):
        load_image(data)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGBA", "CMYK", "I", "I;16", "F"])
def test_odd_modes_are_converted_to_rgb(mode):
    image = load_image(Image.new(mode, (8, 8)))
    assert image.mode == "RGB" and image.size == (8, 8)


def test_transparency_becomes_white_not_black():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert load_image(rgba).getpixel((0, 0)) == (255, 255, 255)


# Edge cases kept as explicit regression tests.
@pytest.mark.parametrize(
    "record",
    [
        {
            "data_source": "x",
            "prompt": "q",
            "reward_model": {"ground_truth": "1", "verifier": "math"},
            "extra_info": {"id": 1},
            "images": None,
        },
        {
            "data_source": "x",
            "prompt": [{"role": "user", "content": None}],
            "reward_model": {"ground_truth": "1", "verifier": "math"},
            "extra_info": {"id": "a"},
        },
    ],
)
def test_regressions_fail_or_load_cleanly(record):
    try:
        sample_from_record(record, "r.jsonl:1", check_images=False)
    except SampleError:
        pass


def test_json_round_trip_of_a_valid_record_survives_fuzzed_extra_keys():
    record = {
        "data_source": "x",
        "prompt": "q",
        "reward_model": {"ground_truth": "1", "verifier": "math"},
        "extra_info": {"id": "a", "junk": [1, {"b": None}]},
        "unknown_top_level": 5,
    }
    sample = sample_from_record(json.loads(json.dumps(record)), "r.jsonl:1")
    assert sample.extra_info["junk"] == [1, {"b": None}]
