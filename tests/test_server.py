"""The reward server as a real process on a loopback port, driven over HTTP.

One server (two verifier workers, a bearer token, small limits so that every limit can be hit)
serves the whole module; test plugins register verifiers that crash, hang in a way no timer
signal can interrupt, raise, or sleep.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import pytest
from PIL import Image

from mmrl.datasets.procedural import make_samples
from mmrl.router import Router
from mmrl.server.client import RemoteRouter, RewardClient, RewardServiceUnavailable
from mmrl.server.config import ServeConfig
from mmrl.server.process import start_server_process
from mmrl.types import Sample, VerifyContext
from mmrl.verifiers import get_verifier

TOKEN = "test-token-123"

PLUGIN = """
import os, signal, time
from mmrl.types import VerifierResult
from mmrl.verifiers.registry import Verifier, register_verifier


def _ok():
    return VerifierResult(score=1.0, components={"accuracy": 1.0, "format": 1.0})


@register_verifier("test_crash")
class Crash(Verifier):
    def score(self, response, sample, context):
        if response == "crash":
            os._exit(3)
        return _ok()


@register_verifier("test_hang")
class Hang(Verifier):
    def score(self, response, sample, context):
        if response == "hang":
            # Like SymPy stuck in C code: the verifier's timer signal never gets through.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        return _ok()


@register_verifier("test_raise")
class Raise(Verifier):
    def score(self, response, sample, context):
        raise ValueError("boom")


@register_verifier("test_nan")
class NotANumber(Verifier):
    def score(self, response, sample, context):
        if response == "nan":
            return VerifierResult(score=float("nan"), components={"accuracy": 1.0})
        return VerifierResult(score=1.0, components={"accuracy": float("inf"), "note": "text"})


@register_verifier("test_slow")
class Slow(Verifier):
    def score(self, response, sample, context):
        time.sleep(0.05)
        return _ok()
"""


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    """The server's `image_root`: the only folder it reads image paths from."""
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def server(tmp_path_factory, image_root):
    plugin_dir = tmp_path_factory.mktemp("plugins")
    (plugin_dir / "mmrl_test_plugins.py").write_text(PLUGIN)
    cfg = ServeConfig(
        port=0,
        workers=2,
        token=TOKEN,
        time_limit_s=1.0,
        kill_grace_s=0.5,
        request_timeout_s=60.0,
        max_body_bytes=256 * 1024,
        max_batch=64,
        max_pending=96,
        check_images=True,
        image_root=str(image_root),
        plugins=["mmrl_test_plugins"],
    )
    with start_server_process(cfg, env={"PYTHONPATH": str(plugin_dir)}) as proc:
        yield proc


@pytest.fixture()
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture()
def client(server):
    with RewardClient(server.url, TOKEN, retries=0) as c:
        yield c


def record(verifier: str, ground_truth, **reward) -> dict:
    return {
        "data_source": "test",
        "reward_model": {"ground_truth": ground_truth, "verifier": verifier, **reward},
    }


def expected(sample: Sample, response: str, context: VerifyContext | None = None):
    return get_verifier(sample.reward_model.verifier)(response, sample, context or VerifyContext())


def responses_for(sample: Sample) -> list[str]:
    gt = sample.reward_model.ground_truth
    if sample.reward_model.verifier == "detection":
        shifted = [{**b, "bbox_2d": [c + 2 for c in b["bbox_2d"]]} for b in gt]
        return [json.dumps(gt), f"<answer>{json.dumps(shifted)}</answer>", "no boxes"]
    return [f"\\boxed{{{gt}}}", "\\boxed{7}", "I cannot tell"]


# ---------------------------------------------------------------------------------------------
# Endpoints


def test_health_ready_and_vtriune_root_answer_without_a_token(server):
    with httpx.Client(base_url=server.url) as anonymous:
        assert anonymous.get("/health").json() == {"status": "ok"}
        ready = anonymous.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["ready"] is True and ready.json()["workers_ready"] == 2
        assert {"math", "detection", "test_crash"} <= set(ready.json()["verifiers"])
        # V-Triune's client refuses a server whose root does not say exactly this.
        assert anonymous.get("/").json()["message"] == "Reward Judge Server"


def test_native_scores_equal_the_in_process_verifiers(client):
    samples = make_samples(["colour_code", "arithmetic", "detection", "grounding"], 8, "train")
    rows = [(s, r) for s in samples for r in responses_for(s)]
    context = VerifyContext(step=30, total_steps=100)  # the detection IoU threshold depends on it
    results = client.score([s for s, _ in rows], [r for _, r in rows], context)
    assert len(results) == len(rows)
    for (sample, response), got in zip(rows, results):
        want = expected(sample, response, context)
        assert (got.score, got.components, got.error, got.extracted) == (
            want.score,
            want.components,
            want.error,
            want.extracted,
        ), sample.id
    assert any(r.score == 1.0 for r in results) and any(r.score == 0.0 for r in results)


def test_one_sample_can_answer_several_responses_and_ids_come_back_in_order(http):
    body = {
        "samples": [
            {**record("math", "12"), "extra_info": {"id": "a"}},
            {**record("math", "\\frac{1}{2}"), "extra_info": {"id": "b"}},
        ],
        "responses": ["\\boxed{0.5}", "\\boxed{12}", "\\boxed{13}", "\\boxed{1/2}"],
        "sample_index": [1, 0, 0, 1],
    }
    answer = http.post("/score", json=body).json()
    assert [(r["id"], r["score"]) for r in answer["results"]] == [
        ("b", 1.0),
        ("a", 1.0),
        ("a", 0.0),
        ("b", 1.0),
    ]
    assert answer["errors"] == 0


def _png(colour=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_images_as_local_path_base64_and_data_url_are_accepted(http, image_root):
    (image_root / "sub").mkdir(exist_ok=True)
    (image_root / "sub" / "red.png").write_bytes(_png())
    b64 = base64.b64encode(_png((0, 255, 0))).decode()
    sample = {
        **record("math", "3"),
        "prompt": [{"role": "user", "content": "<image><image><image><image><image>How many?"}],
        "images": [
            "sub/red.png",
            b64,
            f"data:image/png;base64,{b64}",
            {"bytes": b64},
            {"path": "sub/red.png"},
        ],
    }
    answer = http.post("/score", json={"samples": [sample], "responses": ["\\boxed{3}"]})
    assert answer.status_code == 200 and answer.json()["results"][0]["score"] == 1.0

    missing = {**sample, "images": ["sub/nope.png"]}  # inside the root: saying so reveals nothing
    answer = http.post("/score", json={"samples": [missing], "responses": ["\\boxed{3}"]})
    assert answer.status_code == 422
    assert "samples[0].images[0]" in answer.json()["detail"] and "not found" in answer.json()["detail"]


def _image_answer(http, image) -> tuple[int, str]:
    sample = {**record("math", "3"), "images": [image]}
    answer = http.post("/score", json={"samples": [sample], "responses": ["\\boxed{3}"]})
    return answer.status_code, answer.json().get("detail", "")


def test_image_paths_cannot_probe_the_file_system(http, image_root, tmp_path):
    # Issue 36, defect 4: an absolute path, a path climbing out with "..", and a link leading out
    # of the image root get one and the same answer whether or not the file exists.
    outside = tmp_path / "secret.png"
    (image_root / "link_out.png").unlink(missing_ok=True)
    (image_root / "link_out.png").symlink_to(outside)
    climb = "../" * (len(image_root.parts) + 2) + str(outside).lstrip("/")
    for probe in (str(outside), {"path": str(outside)}, climb, "link_out.png"):
        assert not outside.exists()
        absent = _image_answer(http, probe)
        outside.write_bytes(_png())
        present = _image_answer(http, probe)
        outside.unlink()
        assert absent == present, probe
        assert absent[0] == 422 and "not an image path this server reads" in absent[1], absent
    # A real system file is refused in the same words as a missing one.
    assert _image_answer(http, "/etc/hostname")[1].endswith(
        _image_answer(http, "/etc/hostnamf")[1].split(": ", 1)[1]
    )


def test_the_pixel_limit_of_data_loading_applies_to_the_server(http):
    # Issue 36, defect 5: a complete 67-megapixel PNG used to get 200 (64 MP is the limit).
    from mmrl.types import MAX_IMAGE_PIXELS

    buffer = io.BytesIO()
    Image.new("1", (8200, 8200)).save(buffer, format="PNG")  # 67.2 MP, a few kB
    big = base64.b64encode(buffer.getvalue()).decode()
    status, detail = _image_answer(http, big)
    assert status == 422
    assert "samples[0].images[0]" in detail and f"more than the limit of {MAX_IMAGE_PIXELS:,}" in detail


@pytest.mark.parametrize("depth", [70, 600, 900, 2500])
@pytest.mark.parametrize("field", ["ground_truth", "verifier_params"])
def test_deep_json_is_a_4xx_naming_the_field_at_every_depth(http, field, depth):
    # Issue 36, defect 6: 500-900 levels gave 200 with a per-sample RecursionError (pickling),
    # 2,000+ a 400 naming nothing.
    deep = "[" * depth + "1" + "]" * depth
    if field == "ground_truth":
        reward = f'{{"verifier": "math", "ground_truth": {deep}}}'
    else:
        reward = f'{{"verifier": "math", "ground_truth": "3", "verifier_params": {{"format": {deep}}}}}'
    body = f'{{"samples": [{{"reward_model": {reward}}}], "responses": ["\\\\boxed{{3}}"]}}'
    answer = http.post("/score", content=body.encode(), headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert (
        detail.startswith(f"samples[0].reward_model.{field}") and "nested more than 64 levels deep" in detail
    )


def test_openrlhf_empty_lists_give_empty_lists(http):
    answer = http.post("/get_reward", json={"query": [], "prompts": [], "labels": []})
    assert answer.status_code == 200
    assert answer.json() == {"rewards": [], "scores": [], "extra_logs": {}}


def test_openrlhf_labels_are_ground_truths_or_reward_model_json(http):
    prompt = "Is it \\boxed{4}? Answer in \\boxed{}. "
    boxes = [{"bbox_2d": [10, 10, 30, 30], "label": "cat"}]
    detection_label = json.dumps(
        {"verifier": "detection", "ground_truth": boxes, "verifier_params": {"iou_threshold": 0.5}}
    )
    body = {
        "query": [prompt + "\\boxed{4}", prompt + "I don't know", "\\boxed{5}", json.dumps(boxes)],
        "prompts": [prompt, prompt, "", ""],
        "labels": ["4", "4", "4", detection_label],
    }
    answer = http.post("/get_reward", json=body).json()
    # The second query's only \boxed{4} is the prompt's: cut off, the response has no answer.
    assert answer["rewards"] == [1.0, 0.0, 0.0, 1.0]
    assert answer["scores"] == answer["rewards"]
    assert answer["extra_logs"] == {
        "accuracy": [1.0, 0.0, 0.0, 1.0],
        "format": [1.0, 0.0, 1.0, 1.0],
        "verifier_error": [0.0, 0.0, 0.0, 0.0],
    }


def _vtriune_payload(**changes) -> dict:
    parm = {
        "is_training": True,
        "step": 50,
        "total_steps": 100,
        "image_grid_thw": None,
        "image_path": ["/x.png"],
    }
    payload = {
        "response": "<think>\nadd them\n</think>\n<answer>\n\\boxed{4}\n</answer>",
        "prompt": "What is 2 + 2?",
        "answer": "4",
        "solution": "<answer> 4 </answer>",
        "data_source": "toy_math",
        "reward_verifier": "mathverify",
        "reward_verifier_parm": json.dumps(parm),
        "format_ratio": 0.1,
    }
    payload.update(changes)
    return payload


def test_vtriune_judge_scores_their_payload_as_their_server_mixes_it(client):
    answer = client.judge(_vtriune_payload())
    assert answer["error"] is None
    assert answer["rewards"]["accuracy_reward"] == 1.0 and answer["rewards"]["format_reward"] == 1.0
    assert answer["rewards"]["final_reward"] == pytest.approx(1.0)
    # Wrong answer, structure intact: final = (1.0 * 0 + 0.1 * 1) / 1.1, as V-Triune computes it.
    wrong = client.judge(_vtriune_payload(response="<think>\nx\n</think>\n<answer>\n\\boxed{5}\n</answer>"))
    assert wrong["rewards"]["accuracy_reward"] == 0.0
    assert wrong["rewards"]["final_reward"] == pytest.approx(0.1 / 1.1)
    # No format_ratio: V-Triune's default 0.1 applies; one of four tags missing -> format 0.75.
    partial = _vtriune_payload(response="<think>\nx\n</think>\n<answer>\n\\boxed{4}")
    del partial["format_ratio"]
    partial = client.judge(partial)
    assert partial["rewards"]["format_reward"] == 0.75
    assert partial["rewards"]["final_reward"] == pytest.approx((1.0 + 0.1 * 0.75) / 1.1)


def test_vtriune_judge_normalised_detection_takes_the_image_size_from_image_grid_thw(client):
    # Ground truth on Qwen2-VL's 0-1000 grid; the prediction in pixels of a 200 x 100 model input.
    # V-Triune: x / 200 * 1000 and y / 100 * 1000 truncated to integers -> [100, 200, 500, 600].
    gt = "<answer> [{'bbox_2d': [100, 200, 500, 600], 'label': 'dog'}] </answer>"
    prediction = json.dumps([{"bbox_2d": [20, 20, 100, 60], "label": "dog"}])
    parm = {
        "det_verifier_normalized": True,
        "det_reward_ratio": {"iou_max_label_first": 1.0},
        "step": 90,
        "total_steps": 100,
        "image_grid_thw": [[1, 100, 200]],
    }
    payload = _vtriune_payload(
        response=f"<think>\nsee\n</think>\n<answer>\n{prediction}\n</answer>",
        solution=gt,
        reward_verifier="detection",
        reward_verifier_parm=json.dumps(parm),
        format_ratio=0.0,
    )
    answer = client.judge(payload)
    assert answer["error"] is None
    assert answer["rewards"]["final_reward"] == 1.0
    assert answer["rewards"]["pure_iou_score_max_label_reward"] == 1.0
    assert answer["rewards"]["format_reward"] == 1.0


def test_vtriune_judge_answers_200_with_every_key_and_an_error_for_what_it_cannot_score(http):
    # V-Triune's trainer reads rewards[...] of every answer and stops on a 4xx, so /judge never
    # sends one for a sample: zeros under V-Triune's keys, and the reason in "error".
    for body, verifier, message in [
        ({"response": "x", "reward_verifier": "mathverify"}, "mathverify", "solution: missing"),
        (_vtriune_payload(reward_verifier="ocr_v9"), "ocr_v9", "reward_verifier: unknown verifier 'ocr_v9'"),
        (
            _vtriune_payload(reward_verifier_parm="{step: 1"),
            "mathverify",
            "reward_verifier_parm: not valid JSON",
        ),
        (_vtriune_payload(solution="\\{"), "mathverify", "cannot parse"),
        (  # V-Triune: "Check GT!" logged, 0 returned
            _vtriune_payload(
                reward_verifier="detection",
                solution="<answer> [] </answer>",
                reward_verifier_parm=json.dumps({"det_reward_ratio": {"map": 1.0}}),
            ),
            "detection",
            "no valid box",
        ),
        (  # V-Triune: "Normalization factor is zero" logged, 0 returned
            _vtriune_payload(
                reward_verifier="detection",
                solution="<answer> [{'bbox_2d': [1, 1, 2, 2], 'label': 'a'}] </answer>",
            ),
            "detection",
            "weights must not sum to 0",
        ),
    ]:
        answer = http.post("/judge", json=body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        assert message in data["error"], data
        expected_keys = 4 if verifier != "detection" else 4 + 29
        assert len(data["rewards"]) == expected_keys and set(data["rewards"].values()) == {0.0}
    answer = http.post("/judge", content=b"{not json", headers={"Content-Type": "application/json"})
    assert answer.status_code == 200 and "malformed JSON" in answer.json()["error"]


# ---------------------------------------------------------------------------------------------
# Bad input: a 4xx naming the problem, never a 5xx


BAD_REQUESTS = [
    ("malformed JSON", "/score", b'{"samples": [', 400, "malformed JSON"),
    ("not an object", "/score", b"[1, 2]", 422, "body: must be an object"),
    (
        "JSON nested too deeply",
        "/score",
        b"[" * 5000 + b"]" * 5000,
        422,
        "body[0][0][0][0][0][0][0][0]...: nested more than 64 levels deep",
    ),
    (
        "responses not an array",
        "/score",
        {"samples": [record("math", "1")], "responses": "\\boxed{1}"},
        422,
        "responses: must be an array",
    ),
    (
        "an unknown key",
        "/score",
        {"samples": [record("math", "1")], "responses": ["x"], "sampels": [record("math", "2")]},
        400,
        "'sampels': unknown key of a /score request (known: samples, responses, sample_index, context, "
        "timeout_s); did you mean 'samples'?",
    ),
    (
        "a response not a string",
        "/score",
        {"samples": [record("math", "1")], "responses": [1]},
        422,
        "responses[0]: must be a string",
    ),
    (
        "a ratio of the wrong type",
        "/score",
        {"samples": [record("math", "1", accuracy_ratio="high")], "responses": ["x"]},
        422,
        "samples[0].reward_model.accuracy_ratio: must be a number",
    ),
    (
        "unknown verifier",
        "/score",
        {"samples": [record("mathh", "1")], "responses": ["x"]},
        422,
        "samples[0].reward_model.verifier: unknown verifier 'mathh'",
    ),
    (
        "ground truth the verifier rejects",
        "/score",
        {"samples": [record("detection", "no boxes here")], "responses": ["x"]},
        422,
        "samples[0].reward_model.ground_truth: holds no valid box",
    ),
    (
        "unknown verifier parameter value",
        "/score",
        {"samples": [record("math", "1", verifier_params={"format": "weird"})], "responses": ["x"]},
        422,
        "samples[0].reward_model.verifier_params.format",
    ),
    (
        "samples and responses of different lengths",
        "/score",
        {"samples": [record("math", "1")] * 2, "responses": ["x"]},
        422,
        "2 samples but 1 responses",
    ),
    (
        "batch over the limit",
        "/score",
        {"samples": [record("math", "1")] * 65, "responses": ["x"] * 65},
        413,
        "65 responses exceed this server's limit of 64",
    ),
    (
        "oversize body",
        "/score",
        b'{"pad": "' + b"x" * 300_000 + b'"}',
        413,
        "exceeds this server's limit of 262144 bytes",
    ),
    (
        "an unknown math verifier parameter",
        "/score",
        {"samples": [record("math", "1", verifier_params={"bogus": 1})], "responses": ["x"]},
        422,
        "samples[0].reward_model.verifier_params.bogus: unknown parameter for the math verifier",
    ),
    (
        "an integer literal of more than 4300 digits",
        "/score",
        b'{"samples": [{"reward_model": {"ground_truth": "1", "verifier": "math", "accuracy_ratio": 1'
        + b"0" * 5000
        + b'}}], "responses": ["x"]}',
        422,
        "samples[0].reward_model.accuracy_ratio: an integer literal of more than 4300 digits",
    ),
    (
        "NaN in the body",
        "/score",
        b'{"samples": [{"reward_model": {"ground_truth": "1", "verifier": "math", "format_ratio": NaN}}], '
        b'"responses": ["x"]}',
        422,
        "samples[0].reward_model.format_ratio: non-finite number 'NaN'",
    ),
    (
        "a number beyond the float range",
        "/score",
        b'{"samples": [{"reward_model": {"ground_truth": "1", "verifier": "math"}}], "responses": ["x"], '
        b'"timeout_s": 1e999}',
        422,
        "timeout_s: non-finite number '1e999'",
    ),
    (
        "verifier_params as JSON nested too deeply",
        "/score",
        {"samples": [record("math", "1", verifier_params="[" * 5000 + "]" * 5000)], "responses": ["x"]},
        422,
        "samples[0].reward_model.verifier_params[0][0][0][0][0][0][0][0]...: nested more than 64 levels deep",
    ),
    (
        "verifier_params as JSON holding a huge integer",
        "/score",
        {
            "samples": [record("math", "1", verifier_params='{"style": 1' + "0" * 5000 + "}")],
            "responses": ["x"],
        },
        422,
        "samples[0].reward_model.verifier_params.style: an integer literal of more than 4300 digits",
    ),
    (
        "reward_model as JSON holding a huge integer",
        "/score",
        {
            "samples": [{"reward_model": '{"ground_truth": 1' + "0" * 5000 + ', "verifier": "math"}'}],
            "responses": ["x"],
        },
        422,
        "samples[0].reward_model.ground_truth: an integer literal of more than 4300 digits",
    ),
    (
        "extra_info as JSON nested too deeply",
        "/score",
        {
            "samples": [{**record("math", "1"), "extra_info": '{"a":' * 3000 + "1" + "}" * 3000}],
            "responses": ["x"],
        },
        422,
        "samples[0].extra_info.a.a.a.a.a.a.a.a...: nested more than 64 levels deep",
    ),
    (
        "a label's JSON nested too deeply",
        "/get_reward",
        {"query": ["x"], "labels": ['{"verifier": "math", "ground_truth": ' + "[" * 5000 + "]" * 5000 + "}"]},
        422,
        "labels[0].ground_truth[0][0][0][0][0][0][0]...: nested more than 64 levels deep",
    ),
    (
        "a label's JSON holding a huge integer",
        "/get_reward",
        {"query": ["x"], "labels": ['{"verifier": "math", "ground_truth": 1' + "0" * 5000 + "}"]},
        422,
        "labels[0].ground_truth: an integer literal of more than 4300 digits",
    ),
    (
        "a step beyond 64 bits",
        "/get_reward",
        {"query": ["x"], "labels": ["1"], "step": 10**300},
        422,
        "step: must be at most 2^63 - 1",
    ),
    (
        "labels missing",
        "/get_reward",
        {"query": ["\\boxed{1}"], "prompts": ["p"]},
        422,
        "labels: missing",
    ),
    (
        "label the default verifier cannot take",
        "/get_reward",
        {"query": ["\\boxed{1}"], "labels": [[1, 2]]},
        422,
        "labels[0]: must be the ground truth for verifier 'math'",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_input_gets_a_4xx_naming_the_problem(http, case, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    assert message in answer.json()["detail"]


def _strict_json(text: str):
    """Parse as JSON proper: NaN and infinities are not JSON."""

    def refuse(name):
        raise AssertionError(f"the server sent {name}, which is not JSON: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def test_judge_refuses_non_finite_and_unusable_numbers_and_never_sends_nan(http):
    huge = "1" + "0" * 5000
    deep = "[" * 5000 + "]" * 5000
    deep_enough = '{"a":' * 900 + "1" + "}" * 900
    cases = [
        ('"accuracy_ratio": Infinity', "accuracy_ratio: non-finite number 'Infinity'"),
        ('"format_ratio": -Infinity', "format_ratio: non-finite number '-Infinity'"),
        ('"accuracy_ratio": 1e400', "accuracy_ratio: non-finite number '1e400'"),
        ('"accuracy_ratio": 1' + "0" * 400, "accuracy_ratio: must be a finite number"),
        (f'"accuracy_ratio": {huge}', "accuracy_ratio: an integer literal of more than 4300 digits"),
        (
            '"reward_verifier_parm": ' + json.dumps('{"step": ' + huge + "}"),
            "reward_verifier_parm.step: an integer literal of more than 4300 digits",
        ),
        (
            '"reward_verifier_parm": ' + json.dumps(deep),
            "reward_verifier_parm[0][0][0][0][0][0][0][0]...: nested more than 64 levels deep",
        ),
        (
            '"reward_verifier_parm": ' + json.dumps(deep_enough),
            "reward_verifier_parm: not valid JSON: nested more than 64 levels deep",
        ),
    ]
    base = json.dumps({"response": "\\boxed{4}", "solution": "4", "reward_verifier": "mathverify"})
    for fields, message in cases:
        body = (base[:-1] + ", " + fields + "}").encode()
        answer = http.post("/judge", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 200, answer.text
        data = _strict_json(answer.text)
        assert data["error"] and message in data["error"], (message, data)
        assert set(data["rewards"].values()) == {0.0}
    # Both ratios at 1e308: their sum overflows, yet the mix is still half and half.
    payload = _vtriune_payload(accuracy_ratio=1e308, format_ratio=1e308)
    answer = _strict_json(http.post("/judge", json=payload).text)
    assert answer["error"] is None, answer
    rewards = answer["rewards"]
    assert rewards["accuracy_reward"] == 1.0 and rewards["format_reward"] == 1.0
    assert rewards["final_reward"] == 1.0
    payload = _vtriune_payload(
        accuracy_ratio=1e308, format_ratio=1e308, response="<answer>\\boxed{4}</answer>"
    )
    rewards = _strict_json(http.post("/judge", json=payload).text)["rewards"]
    assert rewards["accuracy_reward"] == 1.0 and rewards["format_reward"] < 1.0
    assert rewards["final_reward"] == pytest.approx(0.5 + 0.5 * rewards["format_reward"])


def test_a_verifier_returning_nan_or_infinity_gives_an_error_result_never_nan_on_the_wire(http):
    answer = http.post("/score", json={"samples": [record("test_nan", "-")] * 2, "responses": ["nan", "inf"]})
    assert answer.status_code == 200
    data = _strict_json(answer.text)
    assert data["errors"] == 2
    first, second = data["results"]
    assert first["score"] == 0.0 and "non-finite score" in first["error"]
    assert second["score"] == 0.0 and "non-finite component 'accuracy'" in second["error"]
    label = json.dumps({"verifier": "test_nan", "ground_truth": "-"})
    answer = http.post("/get_reward", json={"query": ["nan", "inf"], "labels": [label, label]})
    assert answer.status_code == 200
    data = _strict_json(answer.text)
    assert data["rewards"] == [0.0, 0.0] and data["extra_logs"]["verifier_error"] == [1.0, 1.0]


def test_null_verifier_params_are_taken_as_not_given(http):
    sample = record("counting", "3", verifier_params={"partial": True, "options": None})
    answer = http.post("/score", json={"samples": [sample], "responses": ["\\boxed{3}"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["score"] == 1.0


def test_a_ground_truth_too_deep_to_hand_to_a_worker_is_a_422_naming_it(http):
    # Issue 36: 700 levels parse as JSON but cannot be pickled for a worker; this used to be a
    # 200 with that sample's RecursionError. The depth limit (64) now refuses it up front.
    deep: list = []
    for _ in range(700):
        deep = [deep]
    body = {"samples": [record("detection", deep), record("math", "2")], "responses": ["[]", "\\boxed{2}"]}
    answer = http.post("/score", json=body)
    assert answer.status_code == 422
    assert answer.json()["detail"] == (
        "samples[0].reward_model.ground_truth: nested more than 64 levels deep (this server's limit)"
    )


def test_a_missing_or_wrong_token_is_401(server):
    body = {"samples": [record("math", "1")], "responses": ["\\boxed{1}"]}
    with httpx.Client(base_url=server.url) as anonymous:
        answer = anonymous.post("/score", json=body)
        assert answer.status_code == 401 and "missing bearer token" in answer.json()["detail"]
        assert answer.headers["www-authenticate"] == "Bearer"
        answer = anonymous.post("/score", json=body, headers={"Authorization": "Bearer wrong"})
        assert answer.status_code == 401 and "invalid bearer token" in answer.json()["detail"]
        assert anonymous.get("/metrics").status_code == 401


def test_the_server_refuses_to_bind_beyond_loopback_without_a_token(monkeypatch, capsys):
    from mmrl.server import main

    monkeypatch.delenv("MMRL_SERVE_TOKEN", raising=False)
    assert main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "refusing to bind '0.0.0.0' without a token" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Verifiers that crash, hang or raise


def test_crashing_hanging_and_raising_verifiers_give_error_results_and_serving_goes_on(client, http):
    rows = [
        (record("test_crash", "-"), "fine"),
        (record("test_crash", "-"), "crash"),
        (record("math", "2"), "\\boxed{2}"),
        (record("test_hang", "-"), "hang"),
        (record("test_raise", "-"), "anything"),
        (record("test_hang", "-"), "fine"),
    ]
    results = client.score_records([r for r, _ in rows], [t for _, t in rows])
    assert [r["score"] for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert results[0]["error"] is None and results[2]["error"] is None and results[5]["error"] is None
    assert "worker process died while scoring this sample (exit code 3)" in results[1]["error"]
    assert results[3]["error"].startswith("timeout") and "worker process was killed" in results[3]["error"]
    assert results[4]["error"] == "ValueError: boom"
    # Still serving: with both workers (replacements warm up in the background) or without.
    again = http.post("/score", json={"samples": [record("math", "3")], "responses": ["\\boxed{3}"]})
    assert again.status_code == 200 and again.json()["results"][0]["score"] == 1.0
    metrics = http.get("/metrics").text
    assert 'mmrl_verifier_errors_total{verifier="test_crash",kind="crash"} 1' in metrics
    assert 'mmrl_verifier_errors_total{verifier="test_hang",kind="timeout"} 1' in metrics
    assert 'mmrl_verifier_errors_total{verifier="test_raise",kind="error"} 1' in metrics
    restarts = [line for line in metrics.splitlines() if line.startswith("mmrl_worker_restarts_total ")]
    assert float(restarts[0].split()[1]) >= 2


def test_a_full_queue_answers_429_with_retry_after_and_the_client_retries(server, http):
    slow = {"samples": [record("test_slow", "-")], "responses": ["x"] * 60, "sample_index": [0] * 60}
    first: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: first.append(http.post("/score", json=slow)))
    thread.start()
    deadline = time.monotonic() + 30
    while http.get("/ready").json()["pending"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    more = {"samples": [record("test_slow", "-")], "responses": ["x"] * 40, "sample_index": [0] * 40}
    answer = http.post("/score", json=more)
    assert answer.status_code == 429, answer.text
    assert answer.headers["retry-after"] == "1" and "server busy" in answer.json()["detail"]
    # The client waits and retries; once the first request drains, its request goes through.
    with RewardClient(server.url, TOKEN, retries=8, backoff_s=0.2, max_backoff_s=1.0) as patient:
        results = patient.score_records(more["samples"], more["responses"], sample_index=more["sample_index"])
    assert [r["score"] for r in results] == [1.0] * 40
    thread.join()
    assert first[0].status_code == 200


def test_a_request_past_its_time_limit_answers_with_timeout_errors_for_the_rest(http):
    body = {"samples": [record("test_slow", "-")], "responses": ["x"] * 40, "sample_index": [0] * 40}
    answer = http.post("/score", json={**body, "timeout_s": 0.3})
    assert answer.status_code == 200
    results = answer.json()["results"]
    late = [r for r in results if r["error"] is not None]
    assert late, "40 samples of 50 ms on two workers cannot all be scored in 0.3 s"
    assert all(r["error"].startswith("timeout: the request's 0.3s limit passed") for r in late)
    assert all(r["score"] == 1.0 for r in results if r["error"] is None)
    # What was still queued is dropped, not scored for nobody: the queue drains.
    deadline = time.monotonic() + 30
    while http.get("/ready").json()["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/ready").json()["pending"] == 0


def test_metrics_are_prometheus_text_with_requests_latency_and_errors(http):
    http.post("/score", json={"samples": [record("math", "1")], "responses": ["\\boxed{1}"]})
    answer = http.get("/metrics")
    assert answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    assert "# TYPE mmrl_requests_total counter" in text
    assert 'mmrl_requests_total{endpoint="/score",status="200"}' in text
    assert "# TYPE mmrl_request_duration_seconds histogram" in text
    assert 'mmrl_request_duration_seconds_bucket{endpoint="/score",le="+Inf"}' in text
    assert 'mmrl_samples_total{verifier="math"}' in text
    assert "mmrl_workers_ready" in text and "mmrl_pending_samples" in text


# ---------------------------------------------------------------------------------------------
# Client side: veRL, TRL, RemoteRouter


def test_verl_compute_score_reads_the_server_from_the_environment(server, monkeypatch):
    from mmrl.integrations import verl

    monkeypatch.setenv("MMRL_REWARD_URL", server.url)
    monkeypatch.setenv("MMRL_REWARD_TOKEN", TOKEN)
    verl.reset_default_client()
    try:
        assert verl.compute_score("geo3k", "so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
        assert verl.compute_score("geo3k", "so \\boxed{2}", "0.5", extra_info={"index": 3}) == 0.0
        boxes = [{"bbox_2d": [1, 1, 20, 20], "label": "cat"}]
        extra = {"reward_model": {"verifier": "detection", "verifier_params": {"iou_threshold": 0.5}}}
        assert verl.compute_score("coco", json.dumps(boxes), boxes, extra_info=extra) == 1.0
        batch = verl.compute_score_batch(["a", "b"], ["\\boxed{1}", "\\boxed{3}"], ["1", "2"], [None, None])
        assert batch == [1.0, 0.0]
    finally:
        verl.reset_default_client()


def test_verl_factory_returns_verl_dicts_and_picks_verifiers_by_data_source(server):
    from mmrl.integrations.verl import make_compute_score

    compute = make_compute_score(server.url, TOKEN, verifiers_by_source={"mcq": "choice"}, return_dict=True)
    assert compute("toy", "\\boxed{4}", "4") == {"score": 1.0, "accuracy": 1.0, "format": 1.0, "error": 0.0}
    choice = compute("mcq", "\\boxed{B}", "B", extra_info={"verifier_params": {"options": ["red", "blue"]}})
    assert choice["score"] == 1.0


def test_trl_reward_function_scores_plain_and_conversational_completions(server):
    from mmrl.integrations.trl import make_reward_function

    reward = make_reward_function(server.url, TOKEN, name="mmrl_math")
    assert reward.__name__ == "mmrl_math"
    prompts = ["What is 1+1?"] * 3
    assert reward(
        prompts=prompts, completions=["\\boxed{2}", "\\boxed{3}", "no idea"], solution=["2"] * 3
    ) == [
        1.0,
        0.0,
        0.0,
    ]
    conversational = [
        [{"role": "assistant", "content": "\\boxed{2}"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "\\boxed{5}"}]}],
    ]
    boxes = [{"bbox_2d": [1, 1, 20, 20], "label": "cat"}]
    rm = [
        {"ground_truth": "2", "verifier": "math"},
        json.dumps({"ground_truth": boxes, "verifier": "detection"}),
    ]
    conversational[1][0]["content"][0]["text"] = json.dumps(boxes)
    scores = reward(prompts=prompts[:2], completions=conversational, reward_model=rm, trainer_state=None)
    assert scores == [1.0, 1.0]
    with pytest.raises(KeyError, match="needs a 'reward_model' or a 'ground_truth / solution / answer'"):
        reward(prompts=prompts, completions=["x"] * 3, other=[1, 2, 3])


def test_trl_reward_function_drops_the_nulls_of_arrow_struct_columns(server):
    from mmrl.integrations.trl import make_reward_function

    # What a datasets/Arrow struct column gives TRL: every key of every row, missing ones as None.
    rows = [
        {
            "ground_truth": "3",
            "verifier": "counting",
            "verifier_params": {"options": None, "partial": True},
            "accuracy_ratio": None,
            "format_ratio": None,
        },
        {
            "ground_truth": "B",
            "verifier": "choice",
            "verifier_params": {"options": ["red", "blue"], "partial": None},
            "accuracy_ratio": 1.0,
            "format_ratio": None,
        },
    ]
    reward = make_reward_function(server.url, TOKEN, retries=0)
    scores = reward(prompts=["p", "q"], completions=["\\boxed{3}", "\\boxed{B}"], reward_model=rows)
    assert scores == [1.0, 1.0]


def test_trl_adapter_sends_no_null_parameters():
    from mmrl.integrations.trl import make_reward_function

    class Capture:
        def score_records(self, records, texts, context, sample_index):
            self.records = records
            return [{"score": 1.0, "error": None} for _ in texts]

    capture = Capture()
    reward = make_reward_function(client=capture)
    row = {
        "ground_truth": [{"bbox_2d": [1, 2, 3, None], "label": None}],  # the ground truth is kept as is
        "verifier": "detection",
        "verifier_params": {"weights": {"map": 1.0, "map50": None}, "iou_threshold": None},
        "accuracy_ratio": None,
    }
    assert reward(completions=["x"], reward_model=[row]) == [1.0]
    assert capture.records == [
        {
            "reward_model": {
                "ground_truth": [{"bbox_2d": [1, 2, 3, None], "label": None}],
                "verifier": "detection",
                "verifier_params": {"weights": {"map": 1.0}},
            }
        }
    ]


def test_remote_router_gives_the_in_process_router_results(server):
    samples = make_samples(["colour_code", "count", "detection"], 6, "train")
    rows = [s for s in samples for _ in range(2)]
    texts = [responses_for(s)[i % 2] for i, s in enumerate(rows)]
    context = VerifyContext(step=3, total_steps=10)
    with Router(num_workers=0) as local, RemoteRouter(server.url, TOKEN, batch_size=5) as remote:
        assert remote.warm_up() >= 0.0
        want = local.score(rows, texts, context)
        got = remote.score(rows, texts, context)
        assert got.scores.tolist() == want.scores.tolist()
        assert [r.components for r in got.results] == [r.components for r in want.results]
        assert got.errors == want.errors
        # Streaming: rows added as they finish, one re-added with another text, one never added.
        pending = remote.start(context, len(rows))
        for row in range(len(rows) - 1):
            pending.add(row, rows[row], "\\boxed{0}" if row == 2 else texts[row])
        again = pending.result(rows, texts)
        assert again.scores.tolist() == want.scores.tolist()


def test_remote_router_errors_surface_when_the_server_is_unreachable():
    router = RemoteRouter("http://127.0.0.1:9", retries=2, backoff_s=0.01, connect_timeout_s=1.0)
    sample = make_samples(["colour_code"], 1, "train")[0]
    with router, pytest.raises(RewardServiceUnavailable, match="failed after 3 attempt"):
        router.score([sample], ["\\boxed{1}"], VerifyContext())


def test_a_dead_worker_s_messages_are_queued_again_without_the_sample_it_was_scoring():
    """A message holds spans of several requests; the worker's progress (message, index in
    it) picks out the one sample to blame, and everything else it held goes back in order."""
    from mmrl.verifier_pool import _take_back

    a, b, c = object(), object(), object()
    chunks = {5: ([[a, 0, 3], [b, 2, 6]], 7), 6: ([[c, 0, 2]], 2)}
    requeue, culprit = _take_back(chunks, (5, 4))  # index 4 of message 5: b's item 3
    assert culprit == (b, 3)
    assert requeue == [[a, 0, 3], [b, 2, 3], [b, 4, 6], [c, 0, 2]]
    assert _take_back(chunks, (5, 3))[0] == [[a, 0, 3], [b, 3, 6], [c, 0, 2]]  # b's first
    assert _take_back(chunks, (6, 1)) == ([[a, 0, 3], [b, 2, 6], [c, 0, 1]], (c, 1))
    # Between samples (no progress recorded) nothing is blamed and nothing is lost.
    assert _take_back(chunks, None) == ([[a, 0, 3], [b, 2, 6], [c, 0, 2]], None)


def test_worker_rendered_results_are_the_json_the_server_would_write():
    """Workers write a /score result's fields as JSON text; with the id added it must be what
    `json.dumps` writes for the result object, escapes included. A non-finite score or
    component (NaN is not JSON), or a component that is no number, is refused with ValueError
    (the worker makes it the sample's error)."""
    from mmrl.server.protocol import render_fields, result_json, score_response_json

    cases = [
        (1.0, {"accuracy": 1.0, "format": 1.0}, "4"),
        (0.25, {'a\u00e9\n"': 0.5, "x": -2.0, 3: 1, "w": True}, None),
        (1e-300, {}, 'caf\u00e9 \U0001f600 "q" \\'),
        (0.1 + 0.2, {"int": 7}, 7),
        (0.5, {1: 0.5}, None),
        (0.5, {True: 0.5}, None),  # equal to the key 1, but named "True"
        (0.5, {1: 0.25, "1": 0.75}, None),  # one key "1" in JSON, as the tuple path has it
    ]
    ids = ["s\u00e91", "two", "s\u00e91", "four", "five", "six", "seven"]
    rendered = [render_fields(score, components, extracted) for score, components, extracted in cases]
    expected = []
    for sample_id, (score, components, extracted) in zip(ids, cases):
        fields = {str(k): float(v) for k, v in components.items()}
        result = (score, fields, None, None if extracted is None else str(extracted), None)
        expected.append(json.dumps(result_json(sample_id, result), separators=(",", ":"), allow_nan=False))
    for sample_id, text, want in zip(ids, rendered, expected):
        assert '{"id":' + json.dumps(sample_id) + "," + text == want
    # Mixed with an error result (a tuple), the body is the one json.dumps writes.
    assert rendered[4] != rendered[5] and rendered[6].count('"1":') == 1
    results = [rendered[0], (0.0, {}, "boom", None, None), *rendered[2:]]
    body = score_response_json(ids, results)
    objects = [json.loads(expected[0]), result_json("two", results[1]), *map(json.loads, expected[2:])]
    assert body.decode() == json.dumps({"results": objects, "errors": 1}, separators=(",", ":"))
    for score, components, message in [
        (float("nan"), {}, "non-finite score"),
        (float("-inf"), {}, "non-finite score"),
        (1.0, {"a": float("nan")}, "non-finite component 'a'"),
        (1.0, {"b": float("inf")}, "non-finite component 'b'"),
        (1.0, {"c": "not a number"}, "component 'c' that is not a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            render_fields(score, components, None)


def test_writes_of_one_loop_turn_leave_as_one_and_close_sends_what_is_pending():
    """uvicorn writes a response's head and body separately; the server's transport joins
    them so each response is one segment, in order, and nothing is lost on close."""
    import asyncio

    from mmrl.server.app import _CoalescingTransport

    class Recorder:
        def __init__(self):
            self.calls: list = []

        def write(self, data):
            self.calls.append(("write", data))

        def close(self):
            self.calls.append(("close",))

        def is_closing(self):
            return ("close",) in self.calls

        def get_extra_info(self, name):
            return f"info:{name}"

    async def main():
        raw = Recorder()
        transport = _CoalescingTransport(raw, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert raw.calls == []  # held until the end of this turn
        await asyncio.sleep(0)
        assert raw.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]
        transport.write(b"last")
        transport.close()
        await asyncio.sleep(0)
        assert raw.calls[1:] == [("write", b"last"), ("close",)]
        assert transport.get_extra_info("peername") == "info:peername"

    asyncio.run(main())
