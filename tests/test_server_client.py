"""Reward-server pieces that need no server: the client's retry rules (against a fake transport),
the config's rules, and the converters from OpenRLHF / V-Triune payloads."""

from __future__ import annotations

import json

import httpx
import pytest

from mmrl.server.client import (
    RewardClient,
    RewardRequestError,
    RewardServiceUnavailable,
    base_url,
)
from mmrl.server.config import ServeConfig, is_loopback, load_serve_config
from mmrl.server.protocol import RequestError, parse_get_reward, parse_judge, parse_score_request

KNOWN = frozenset({"math", "detection", "choice"})
OK = {"results": [{"id": "x", "score": 1.0, "components": {}, "error": None, "extracted": "1"}], "errors": 0}
RECORD = {"reward_model": {"ground_truth": "1", "verifier": "math"}}


def scripted_client(answers: list, **options) -> tuple[RewardClient, list[float], list[httpx.Request]]:
    """A client whose transport plays `answers` in order (a Response, or an exception to raise)."""
    sleeps: list[float] = []
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[len(seen) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = RewardClient(
        "http://reward:8000/get_reward",
        "tok",
        transport=httpx.MockTransport(handler),
        sleep=sleeps.append,
        **options,
    )
    return client, sleeps, seen


def test_busy_and_unavailable_answers_are_retried_with_doubling_backoff():
    answers = [
        httpx.Response(503, json={"detail": "warming up"}),
        httpx.ConnectError("refused"),
        httpx.Response(502, text="bad gateway"),
        httpx.Response(200, json=OK),
    ]
    client, sleeps, seen = scripted_client(answers, retries=3, backoff_s=0.1, max_backoff_s=10)
    assert client.score_records([RECORD], ["\\boxed{1}"]) == OK["results"]
    assert len(seen) == 4
    # 0.1, 0.2, 0.4 seconds, each jittered upwards by at most 25%.
    for got, base in zip(sleeps, [0.1, 0.2, 0.4]):
        assert base <= got <= 1.25 * base
    assert seen[0].headers["authorization"] == "Bearer tok"
    assert str(seen[0].url) == "http://reward:8000/score"


def test_retry_after_is_honoured_within_the_backoff_cap():
    answers = [
        httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "busy"}),
        httpx.Response(200, json=OK),
    ]
    client, sleeps, _ = scripted_client(answers, retries=1, backoff_s=0.1, max_backoff_s=5)
    client.score_records([RECORD], ["x"])
    assert sleeps == [3.0]
    answers = [
        httpx.Response(429, headers={"Retry-After": "60"}, json={"detail": "busy"}),
        httpx.Response(200, json=OK),
    ]
    client, sleeps, _ = scripted_client(answers, retries=1, backoff_s=0.1, max_backoff_s=5)
    client.score_records([RECORD], ["x"])
    assert sleeps == [5.0]


def test_retries_are_bounded_and_the_last_error_is_reported():
    client, sleeps, seen = scripted_client([httpx.ReadTimeout("slow")] * 3, retries=2, backoff_s=0.01)
    with pytest.raises(
        RewardServiceUnavailable,
        match=r"POST http://reward:8000/score failed after 3 attempt\(s\): timed out",
    ):
        client.score_records([RECORD], ["x"])
    assert len(seen) == 3 and len(sleeps) == 2


def test_a_rejected_request_is_not_retried_and_carries_the_server_message():
    detail = "samples[0].reward_model.verifier: unknown verifier 'mathh'"
    client, sleeps, seen = scripted_client([httpx.Response(422, json={"detail": detail})], retries=5)
    with pytest.raises(RewardRequestError, match="HTTP 422: samples\\[0\\].reward_model.verifier") as info:
        client.score_records([RECORD], ["x"])
    assert info.value.status == 422 and info.value.detail == detail
    assert len(seen) == 1 and sleeps == []


def test_large_batches_are_split_and_shared_samples_sent_once():
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        results = [
            {"id": str(i), "score": float(i), "components": {}, "error": None, "extracted": None}
            for i in body["sample_index"]
        ]
        return httpx.Response(200, json={"results": results, "errors": 0})

    client = RewardClient("http://reward:1", transport=httpx.MockTransport(handler), max_batch=3)
    records = [{"reward_model": {"ground_truth": str(i), "verifier": "math"}} for i in range(2)]
    out = client.score_records(records, ["a"] * 5, sample_index=[0, 0, 1, 1, 0])
    assert [len(b["responses"]) for b in bodies] == [3, 2]
    assert [len(b["samples"]) for b in bodies] == [2, 2]
    assert bodies[0]["sample_index"] == [0, 0, 1] and bodies[1]["sample_index"] == [0, 1]
    assert [r["score"] for r in out] == [0.0, 0.0, 1.0, 0.0, 1.0]


def test_base_url_accepts_endpoint_urls():
    assert base_url("http://h:1/get_reward") == "http://h:1"
    assert base_url("http://h:1/judge/") == "http://h:1"
    assert base_url("http://h:1") == "http://h:1"


# ---------------------------------------------------------------------------------------------
# Config


def test_binding_beyond_loopback_needs_a_token():
    assert (
        is_loopback("127.0.0.1")
        and is_loopback("::1")
        and is_loopback("localhost")
        and is_loopback("127.8.0.1")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without a token"):
        ServeConfig(host="0.0.0.0").validate()
    ServeConfig(host="0.0.0.0", token="secret").validate()
    ServeConfig().validate()


def test_config_file_then_flags_then_environment_token(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    path.write_text("host: 0.0.0.0\nport: 9000\nworkers: 3\nmax_batch: 8\n")
    monkeypatch.setenv("MMRL_SERVE_TOKEN", "from-env")
    cfg = load_serve_config(path, {"port": 9100, "workers": None})
    assert (cfg.host, cfg.port, cfg.workers, cfg.max_batch, cfg.token) == ("0.0.0.0", 9100, 3, 8, "from-env")
    monkeypatch.delenv("MMRL_SERVE_TOKEN")
    with pytest.raises(ValueError, match="refusing to bind"):
        load_serve_config(path)
    path.write_text("max_bach: 8\n")
    with pytest.raises(Exception, match="max_bach"):
        load_serve_config(path)
    with pytest.raises(ValueError, match="label_mode must be one of"):
        load_serve_config(None, {"label_mode": "guess"})


# ---------------------------------------------------------------------------------------------
# Converters


def test_openrlhf_label_modes():
    labels = ["3", json.dumps({"verifier": "choice", "ground_truth": "B", "id": "q7"}), '{"a": 1}']
    body = {"query": ["x", "y", "z"], "labels": labels}
    auto = parse_get_reward(body, KNOWN, 10, "auto", "math")
    assert [fields[0] for fields, *_ in auto.items] == ["math", "choice", "math"]
    assert (
        auto.items[2][0][1] == '{"a": 1}'
    )  # a JSON object without "verifier" is a ground truth in auto mode
    assert auto.ids == ["labels[0]", "q7", "labels[2]"]
    plain = parse_get_reward(body, KNOWN, 10, "ground_truth", "math")
    assert [fields[0] for fields, *_ in plain.items] == ["math"] * 3 and plain.items[1][0][1] == labels[1]
    with pytest.raises(RequestError, match=r"labels\[0\]: must be a reward_model object"):
        parse_get_reward(body, KNOWN, 10, "reward_model", "math")
    with pytest.raises(RequestError, match=r"labels\[0\].verifier: missing"):
        parse_get_reward({"query": ["z"], "labels": labels[2:]}, KNOWN, 10, "reward_model", "math")


def test_vtriune_judge_payload_becomes_an_mmrl_sample():
    parm = {
        "det_verifier_normalized": True,
        "det_reward_ratio": json.dumps({"iou_max_label_first": 0.5, "map": 0.5, "iou_completeness": 0.2}),
        "is_training": True,
        "step": 7,
        "total_steps": 70,
        "image_grid_thw": [[1, 280, 420]],
        "image_path": ["/data/x.jpg"],
    }
    payload = {
        "response": "<answer>[]</answer>",
        "prompt": "find the dog",
        "answer": "[{'bbox_2d': [1, 2, 3, 4], 'label': 'dog'}]",
        "solution": "<answer> [{'bbox_2d': [1, 2, 3, 4], 'label': 'dog'}] </answer>",
        "data_source": "coco",
        "reward_verifier": "detection",
        "reward_verifier_parm": json.dumps(parm),
        "accuracy_ratio": 1.0,
        "fmt_ratio": 0.25,
    }
    ((fields, response, step, total, native),) = parse_judge(payload, KNOWN, 0.1).items
    verifier, gt, params, accuracy, fmt, data_source, _, prompt = fields
    assert verifier == "detection" and data_source == "coco" and prompt == "find the dog"
    assert gt == [{"bbox_2d": [1, 2, 3, 4], "label": "dog"}]
    # V-Triune's DetectionVerifier: a ratio it is not given is 0; the threshold mode is the
    # server's (V-Triune: $DET_IOU_THRESHOLD, effectively "average").
    assert params == {
        "style": "vtriune",
        "normalized": True,
        "iou_threshold": "average",
        "image_size": [420.0, 280.0],
        "completeness_weight": 0.2,
        "weights": {
            "iou_max_label_first": 0.5,
            "iou_max_iou_first": 0.0,
            "map": 0.5,
            "map50": 0.0,
            "map75": 0.0,
        },
    }
    # A ratio outside [0, 1] is reset to 0 (V-Triune logs a warning), not rejected.
    payload["reward_verifier_parm"] = json.dumps({**parm, "det_reward_ratio": {"map": 1.5, "map50": 1.0}})
    params = parse_judge(payload, KNOWN, 0.1, "dynamic").items[0][0][2]
    assert params["weights"]["map"] == 0.0 and params["weights"]["map50"] == 1.0
    assert params["completeness_weight"] == 0.0 and params["iou_threshold"] == "dynamic"
    # No image grid: V-Triune scores the boxes unscaled (mmrl used to reject the payload).
    payload["reward_verifier_parm"] = json.dumps({**parm, "image_grid_thw": None})
    params = parse_judge(payload, KNOWN, 0.1).items[0][0][2]
    assert params["normalized"] is True and "image_size" not in params
    assert (accuracy, fmt) == (pytest.approx(0.8), pytest.approx(0.2))  # 1 : 0.25, normalised
    assert (step, total, response, native) == (7, 70, "<answer>[]</answer>", False)
    math_item = parse_judge(
        {"response": "r", "solution": "4", "reward_verifier": "mathverify"}, KNOWN, 0.1
    ).items[0][0]
    assert math_item[0] == "math" and math_item[2] == {"format": "think_answer", "style": "vtriune"}
    assert (math_item[3], math_item[4]) == (pytest.approx(1 / 1.1), pytest.approx(0.1 / 1.1))


def test_native_request_checks_name_the_field():
    with pytest.raises(RequestError, match=r"sample_index\[1\]: must be an integer in \[0, 1\), got 4"):
        parse_score_request({"samples": [RECORD], "responses": ["a", "b"], "sample_index": [0, 4]}, KNOWN, 10)
    with pytest.raises(RequestError, match=r"context.total_steps: must be >= 1, got 0"):
        parse_score_request(
            {"samples": [RECORD], "responses": ["a"], "context": {"total_steps": 0}}, KNOWN, 10
        )
    bad = {"reward_model": {"ground_truth": "1", "verifier": "math", "verifier_params": "{oops"}}
    with pytest.raises(
        RequestError, match=r"samples\[0\].reward_model.verifier_params: not valid JSON"
    ) as info:
        parse_score_request({"samples": [bad], "responses": ["a"]}, KNOWN, 10)
    assert info.value.status == 422
