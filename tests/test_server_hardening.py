"""Issue 36: the reward server's hardening round three, without a server process (the HTTP-level
checks of the same points are in tests/test_server.py): image paths only under `image_root`
with one answer for every refused path, the pixel limit, deep JSON naming its field, the
detection ground truth's size limit said as such, and `/judge` math scored by mmrl's verifier
with the disagreements with V-Triune's settings counted."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging

import pytest
from PIL import Image

from mmrl.server.config import ServeConfig
from mmrl.server.metrics import Metrics
from mmrl.server.protocol import (
    IMAGE_PATH_REFUSED,
    MAX_JSON_DEPTH,
    RequestError,
    check_image,
    parse_json,
    parse_judge,
    parse_score_request,
    resolve_image_path,
)
from mmrl.server.scoring import WireScorer
from mmrl.verifiers import get_verifier, verifier_names

KNOWN = frozenset(verifier_names())


def _png(size=(4, 4), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def _refusal(item, root) -> str:
    with pytest.raises(RequestError) as info:
        check_image(item, "samples[0].images[0]", decode=True, image_root=root)
    assert info.value.status == 422
    return info.value.message


def test_paths_resolve_only_inside_the_image_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(_png())
    assert resolve_image_path("sub/a.png", root) == (root / "sub" / "a.png").resolve()
    assert resolve_image_path("./sub/a.png", root) == (root / "sub" / "a.png").resolve()
    for refused in (
        "/etc/hostname",
        str(root / "sub" / "a.png"),
        "../root/sub/a.png",
        "sub/../sub/a.png",
        "~/a.png",
        "",
    ):
        assert resolve_image_path(refused, root) is None, refused
    assert resolve_image_path("sub/a.png", None) is None  # no root: no path is read
    check_image("sub/a.png", "x", decode=True, image_root=root)
    check_image({"path": "sub/a.png"}, "x", decode=True, image_root=root)


@pytest.mark.parametrize("kind", ["absolute", "climb", "link", "absolute_object", "no_root"])
def test_a_refused_path_gets_one_message_whether_or_not_the_file_exists(tmp_path, kind):
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret.png"
    (root / "out.png").symlink_to(secret)
    item = {
        "absolute": str(secret),
        "climb": "../secret.png",
        "link": "out.png",
        "absolute_object": {"path": str(secret)},
        "no_root": "out.png",
    }[kind]
    use_root = None if kind == "no_root" else root
    absent = _refusal(item, use_root)
    secret.write_bytes(_png())
    present = _refusal(item, use_root)
    assert absent == present == f"samples[0].images[0]: {IMAGE_PATH_REFUSED}"


def test_a_missing_file_inside_the_root_is_named(tmp_path):
    assert "not found under the server's image_root" in _refusal("nope.png", tmp_path)


def test_the_server_refuses_images_over_the_data_loading_pixel_limit(tmp_path):
    from mmrl.types import MAX_IMAGE_PIXELS

    big = _png((8200, 8200), "1")  # 67.2 megapixels, complete
    for item in (base64.b64encode(big).decode(), f"data:image/png;base64,{base64.b64encode(big).decode()}"):
        message = _refusal(item, None)
        assert f"8200x8200 pixels is more than the limit of {MAX_IMAGE_PIXELS:,}" in message
    (tmp_path / "big.png").write_bytes(big)
    message = _refusal("big.png", tmp_path)
    assert "big.png: 8200x8200 pixels" in message and str(tmp_path) not in message
    truncated = _png((64, 64))[:-30]
    assert "unreadable image" in _refusal(base64.b64encode(truncated).decode(), None)


def test_image_root_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="image_root .* is not a folder"):
        ServeConfig(check_images=True, image_root=str(tmp_path / "missing")).validate()


def _body(ground_truth: str) -> bytes:
    return f'{{"samples": [{{"reward_model": {{"verifier": "math", "ground_truth": {ground_truth}}}}}], "responses": ["x"]}}'.encode()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 500, 900, 2000, 5000])
def test_deep_json_is_a_422_naming_the_field_at_any_depth(depth):
    deep = "[" * depth + "1" + "]" * depth
    with pytest.raises(RequestError) as info:
        parse_score_request(parse_json(_body(deep)), KNOWN, 8)
    assert info.value.status == 422
    assert info.value.message.startswith("samples[0].reward_model.ground_truth")
    assert f"nested more than {MAX_JSON_DEPTH} levels deep" in info.value.message
    # Objects too, and in a prompt, extra_info and /judge's fields.
    deep_object = '{"a": ' * depth + "1" + "}" * depth
    with pytest.raises(RequestError, match="ground_truth"):
        parse_score_request(parse_json(_body(deep_object)), KNOWN, 8)


def test_json_at_the_depth_limit_is_accepted():
    ok = "[" * (MAX_JSON_DEPTH - 1) + '"3"' + "]" * (MAX_JSON_DEPTH - 1)
    parse_score_request(parse_json(_body(ok)), KNOWN, 8)


@pytest.mark.parametrize("field", ["prompt", "extra_info"])
def test_deep_prompt_and_extra_info_are_refused(field):
    deep = [[[["x"]]]]
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    value = deep if field == "prompt" else {"id": deep}
    record = {"reward_model": {"verifier": "math", "ground_truth": "3"}, field: value}
    with pytest.raises(RequestError, match=f"samples\\[0\\].{field}"):
        parse_score_request({"samples": [record], "responses": ["x"]}, KNOWN, 8)


def test_an_unknown_key_of_a_score_request_is_a_400_naming_it():
    """Issue 48, item 19: `sampels` (or `timeout`) was silently ignored."""
    record = {"reward_model": {"verifier": "math", "ground_truth": "3"}}
    for body, key, hint in (
        ({"samples": [record], "responses": ["x"], "sampels": [record]}, "sampels", "samples"),
        ({"sampels": [record], "responses": ["x"]}, "sampels", "samples"),
        ({"samples": [record], "responses": ["x"], "timeout": 5}, "timeout", "timeout_s"),
        ({"samples": [record], "responses": ["x"], "verbose": True}, "verbose", None),
    ):
        with pytest.raises(RequestError) as info:
            parse_score_request(body, KNOWN, 8)
        assert info.value.status == 400
        assert info.value.message.startswith(f"{key!r}: unknown key of a /score request (known: samples, ")
        assert (f"did you mean {hint!r}?" in info.value.message) == (hint is not None)
    full = {
        "samples": [record],
        "responses": ["x"],
        "sample_index": [0],
        "context": {"step": 1},
        "timeout_s": 5,
    }
    assert len(parse_score_request(full, KNOWN, 8).items) == 1


def test_deep_judge_fields_are_named():
    deep = {"a": 1}
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = {"a": deep}
    for field in ("solution", "reward_verifier_parm"):
        payload = {"response": "x", "solution": "3", "reward_verifier": "mathverify", field: deep}
        with pytest.raises(RequestError, match=f"^{field}: nested more than"):
            parse_judge(payload, KNOWN, 0.1)


def test_a_detection_ground_truth_string_past_the_size_limit_says_so():
    from mmrl.types import RewardSpec, Sample
    from mmrl.verifiers.detection import MAX_ANSWER_CHARS
    from mmrl.verifiers.registry import SampleFieldError

    boxes = [{"bbox_2d": [i % 900, 10, i % 900 + 50, 60], "label": "car"} for i in range(2800)]
    text = json.dumps(boxes)
    assert len(text) > MAX_ANSWER_CHARS
    sample = Sample("d", [], [], "", RewardSpec(text, "detection", {}, 1.0, 0.0), {"id": "s"})
    with pytest.raises(SampleFieldError) as info:
        get_verifier("detection").check_sample(sample)
    assert info.value.field == "reward_model.ground_truth"
    assert f"more than the {MAX_ANSWER_CHARS:,}" in str(info.value) and "no valid box" not in str(info.value)
    # The same boxes as a JSON array are accepted.
    get_verifier("detection").check_sample(
        Sample("d", [], [], "", RewardSpec(boxes, "detection", {}, 1.0, 0.0), {"id": "s"})
    )


class _InlinePool:
    """The verifier pool's `run` interface, scoring in this process (for the handlers alone)."""

    def __init__(self):
        self.scorer = WireScorer(10.0, 16)

    def run(self, items, timeout_s=None):
        loop = asyncio.get_event_loop()

        class Done:
            pass

        job = Done()
        job.results = [self.scorer(item, {}) for item in items]
        job.future = loop.create_future()
        job.future.set_result(None)
        return job


def _judge(endpoints, payload) -> dict:
    status, answer = asyncio.run(endpoints.judge(json.dumps(payload).encode()))
    assert status == 200
    return answer


def test_judge_math_style_mmrl_credits_what_vtriunes_settings_do_not_and_counts_disagreements(caplog):
    from mmrl.server.app import _Endpoints

    cases = [
        ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}"),
        ("\\boxed{\\frac12}", "\\frac{1}{2}"),
        ("\\boxed{5}", "5"),
    ]
    default = _Endpoints(ServeConfig(), _InlinePool(), Metrics(), KNOWN)
    mmrl = _Endpoints(ServeConfig(judge_math="mmrl"), _InlinePool(), Metrics(), KNOWN)
    with caplog.at_level(logging.INFO, logger="mmrl.server"):
        got = {
            style: [
                _judge(ep, {"response": r, "solution": g, "reward_verifier": "mathverify"})["rewards"][
                    "accuracy_reward"
                ]
                for r, g in cases
            ]
            for style, ep in (("vtriune", default), ("mmrl", mmrl))
        }
    # V-Triune's settings (the default, for a drop-in replacement) score the first two 0.
    assert got == {"vtriune": [0.0, 0.0, 1.0], "mmrl": [1.0, 1.0, 1.0]}
    assert (mmrl.metrics.judge_math_compared, mmrl.metrics.judge_math_disagreed) == (3, 2)
    assert (default.metrics.judge_math_compared, default.metrics.judge_math_disagreed) == (0, 0)
    assert "disagree on 1 of 1 samples so far" in caplog.text
    text = mmrl.metrics.render(type("P", (), {"pending": 0, "ready_workers": 1})())
    assert "mmrl_judge_math_compared_total 3" in text and "mmrl_judge_math_disagreements_total 2" in text
    with pytest.raises(ValueError, match="judge_math must be vtriune or mmrl"):
        ServeConfig(judge_math="sympy").validate()
