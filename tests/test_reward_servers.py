"""Rewards from several servers (`reward.remote_url` as a list, `RewardServerPool`): requests
spread by load, a server that stops answering skipped with a doubling back-off and tried again
later, no reward lost while any server answers. First against a scripted transport (the rules,
with a fake clock), then three real `mmrl serve` processes, one killed mid-run."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.server.client import (
    RemoteRouter,
    RewardClient,
    RewardRequestError,
    RewardServerPool,
    RewardServiceUnavailable,
)
from mmrl.types import VerifyContext
from mmrl.verifiers import get_verifier

URLS = ["http://r0:8000", "http://r1:8000", "http://r2:8000"]
SAMPLE = make_samples(["arithmetic"], 1, "train")[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def scripted_pool(answer, clock: Clock | None = None, **options) -> tuple[RewardServerPool, list[str]]:
    """A pool over `URLS` whose transport calls `answer(host, request)` for each request (a
    response, or an exception to raise); returns it and the hosts of the `/score` requests."""
    hosts: list[str] = []
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/score":
            with lock:
                hosts.append(host)
        result = answer(host, request)
        if isinstance(result, Exception):
            raise result
        return result

    clock = clock or Clock()
    pool = RewardServerPool(
        URLS, transport=httpx.MockTransport(handler), clock=clock, sleep=clock.sleep, **options
    )
    return pool, hosts


def ok(request: httpx.Request) -> httpx.Response:
    n = len(json.loads(request.content)["responses"])
    result = {"id": "x", "score": 1.0, "components": {}, "error": None, "extracted": "1"}
    return httpx.Response(200, json={"results": [result] * n, "errors": 0})


def test_requests_go_to_the_server_with_the_fewest_in_flight_then_the_fewest_scored():
    # Three requests held open at once land on three servers.
    release = threading.Event()
    arrived = threading.Semaphore(0)

    def held(host, request):
        arrived.release()
        release.wait(timeout=60)
        return ok(request)

    pool, hosts = scripted_pool(held)
    with ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(pool.score, [SAMPLE], ["1"]) for _ in range(3)]
        for _ in range(3):
            assert arrived.acquire(timeout=60)
        assert sorted(hosts) == ["r0", "r1", "r2"]
        assert [s["in_flight"] for s in pool.stats()] == [1, 1, 1]
        release.set()
        assert all(len(f.result()) == 1 for f in futures)
    # One at a time (nothing in flight), the server that scored the fewest responses goes next:
    # a 5-response request on r0 sends the next ones to r1 and r2 until they catch up.
    hosts.clear()
    pool, hosts = scripted_pool(lambda host, request: ok(request))
    pool.score([SAMPLE] * 5, ["1"] * 5)
    for _ in range(6):
        pool.score([SAMPLE], ["1"])
    assert hosts == ["r0", "r1", "r2", "r1", "r2", "r1", "r2"]
    assert [s["responses"] for s in pool.stats()] == [5, 3, 3]


def test_a_server_that_fails_is_skipped_with_a_doubling_backoff_and_tried_again(caplog):
    clock = Clock()
    down = {"r0"}

    def answer(host, request):
        if host in down:
            return httpx.ConnectError("connection refused")
        return ok(request)

    pool, hosts = scripted_pool(answer, clock, backoff_s=1.0, max_backoff_s=3.0)
    with caplog.at_level(logging.WARNING, logger="mmrl.server.client"):
        assert len(pool.score([SAMPLE], ["1"])) == 1  # r0 first (a tie), then at once r1
    assert hosts == ["r0", "r1"]
    assert "reward server http://r0:8000 did not answer" in caplog.text
    # Skipped for 1 s: the next requests go to the others.
    clock.now += 0.5
    pool.score([SAMPLE], ["1"])
    pool.score([SAMPLE], ["1"])
    assert hosts[2:] == ["r2", "r1"]
    # Tried again after the back-off (it has scored the fewest); still down: skipped for 2 s.
    clock.now += 0.6
    pool.score([SAMPLE], ["1"])
    assert hosts[4:] == ["r0", "r2"]
    r0 = pool.stats()[0]
    assert (r0["failures"], r0["failed_total"], r0["skipped"]) == (2, 2, True)
    clock.now += 1.9
    pool.score([SAMPLE], ["1"])
    assert hosts[6] != "r0"
    # Back up: once its back-off is over it takes requests again, its failures forgotten.
    down.clear()
    clock.now += 0.2
    pool.score([SAMPLE], ["1"])
    assert hosts[-1] == "r0"
    r0 = pool.stats()[0]
    assert (r0["failures"], r0["failed_total"], r0["skipped"], r0["requests"]) == (0, 2, False, 1)


def test_with_every_server_down_a_request_fails_after_its_retries_never_silently():
    clock = Clock()
    pool, hosts = scripted_pool(lambda host, request: httpx.ConnectError("refused"), clock,
                                retries=1, backoff_s=0.5, max_backoff_s=0.5)  # fmt: skip
    with pytest.raises(RewardServiceUnavailable, match="no reward server answered after 6 attempts over 3"):
        pool.score([SAMPLE], ["1"])
    assert sorted(hosts) == ["r0", "r0", "r1", "r1", "r2", "r2"]  # each server retries + 1 times
    assert clock.now > 100.0  # it waited out the back-off before the second round


def test_a_rejected_request_is_not_sent_to_another_server():
    pool, hosts = scripted_pool(lambda host, request: httpx.Response(422, json={"detail": "samples[0]: bad"}))
    with pytest.raises(RewardRequestError, match=r"samples\[0\]: bad"):
        pool.score([SAMPLE], ["1"])
    assert hosts == ["r0"] and [s["in_flight"] for s in pool.stats()] == [0, 0, 0]


def test_a_server_not_ready_at_the_start_is_skipped_and_the_others_used():
    def answer(host, request):
        if host == "r1":
            return httpx.ConnectError("refused")
        if request.url.path == "/ready":
            verifiers = ["math", "ocr"] if host == "r0" else ["math"]
            return httpx.Response(200, json={"status": "ready", "verifiers": verifiers})
        return ok(request)

    pool, hosts = scripted_pool(answer)
    info = pool.wait_ready(timeout_s=5)
    assert info == {"verifiers": ["math"], "servers_ready": 2}  # what every ready server has
    assert [s["skipped"] for s in pool.stats()] == [False, True, False]
    pool.score([SAMPLE], ["1"])
    pool.score([SAMPLE], ["1"])
    assert hosts == ["r0", "r2"]


def test_the_config_takes_a_list_of_servers_and_the_router_spreads_over_them():
    from mmrl.routing import make_router

    cfg = load_config(overrides=[f"reward.remote_url=[{','.join(URLS)}]", "reward.remote_batch_size=8"])
    router = make_router(cfg)
    try:
        assert isinstance(router.client, RewardServerPool)
        assert [s.url for s in router.client.servers] == URLS
        assert router.batch_size == 8 and router._executor._max_workers == 12  # 4 per server
    finally:
        router.close()
    single = make_router(load_config(overrides=["reward.remote_url=http://r0:8000"]))
    assert not isinstance(single.client, RewardServerPool) and single.client.url == "http://r0:8000"
    single.close()
    for bad, message in (("[]", "empty list"), (f"[{URLS[0]},{URLS[0]}]", "twice")):
        with pytest.raises(ValueError, match=message):
            load_config(overrides=[f"reward.remote_url={bad}"])


@pytest.mark.parametrize(
    "value", ["ftp://r0:8000", "r0:8000", "file:///tmp/x", "[http://r0:8000,ftp://r1:8000]", "http://"]
)
def test_a_remote_url_that_is_not_http_is_refused_at_once_naming_it(value):
    """Issue 48, item 19: `ftp://...` was retried for 120 s before it failed."""
    bad = value.strip("[]").split(",")[-1]
    with pytest.raises(
        ValueError, match=rf"reward.remote_url: '{re.escape(bad)}' is not an http:// or https:// URL"
    ):
        load_config(overrides=[f"reward.remote_url={value}"])
    with pytest.raises(ValueError, match=rf"'{re.escape(bad)}' is not an http:// or https:// URL"):
        RewardClient(bad)
    assert load_config(overrides=["reward.remote_url=HTTPS://r0"]).reward.remote_url == "HTTPS://r0"


# ---------------------------------------------------------------------------------------------
# Three real servers, one killed mid-run
# ---------------------------------------------------------------------------------------------


def _samples_scored(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(m.group(1)) for m in re.finditer(r"^mmrl_samples_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    )


@pytest.mark.slow
def test_three_servers_one_killed_mid_run_no_reward_lost_and_the_survivors_share_the_load(caplog):
    from mmrl.server.config import ServeConfig
    from mmrl.server.process import start_server_process

    def start(_):
        return start_server_process(ServeConfig(port=0, workers=1, log_level="warning"))

    with ThreadPoolExecutor(3) as ex:
        servers = list(ex.map(start, range(3)))
    try:
        urls = [s.url for s in servers]
        router = RemoteRouter(urls, batch_size=4, backoff_s=0.2, max_backoff_s=1.0, timeout_s=30)
        router.warm_up()
        samples = make_samples(["arithmetic", "colour_code"], 24, "train")
        texts = [
            f"\\boxed{{{s.reward_model.ground_truth}}}" if i % 3 else "\\boxed{no}"
            for i, s in enumerate(samples)
        ]
        context = VerifyContext(step=3, total_steps=10)
        expected = [get_verifier(s.reward_model.verifier)(t, s, context) for s, t in zip(samples, texts)]
        after_kill = None
        with caplog.at_level(logging.WARNING, logger="mmrl.server.client"):
            for batch in range(6):  # six steps of 48 rows, streamed as a trainer streams them
                if batch == 3:  # the batch the server died in is done: count from here
                    after_kill = [s["responses"] for s in router.client.stats()]
                pending = router.start(context, len(samples))
                for row, (sample, text) in enumerate(zip(samples, texts)):
                    pending.add(row, sample, text)
                    if batch == 2 and row == len(samples) // 2:  # requests to it are in flight
                        os.kill(servers[0].proc.pid, signal.SIGKILL)
                rewards = pending.result(samples, texts)
                # No reward lost: every row scored, each as the in-process verifier scores it.
                got = [(r.score, r.components, r.error) for r in rewards.results]
                assert got == [(e.score, e.components, e.error) for e in expected], batch
        stats = router.client.stats()
        assert stats[0]["failed_total"] >= 1 and "did not answer" in caplog.text
        # Every row was answered by exactly one server (as far as the client counts)...
        assert sum(s["responses"] for s in stats) == 6 * len(samples)
        # ... and each survivor's own count agrees: what the client says it answered, it scored.
        for server, s in zip(servers[1:], stats[1:]):
            assert _samples_scored(server.url) == s["responses"]
        # After the kill the two survivors shared the work.
        after = [s["responses"] - b for s, b in zip(stats, after_kill)]
        assert after[0] == 0 and min(after[1:]) >= 0.25 * sum(after[1:]), after
        router.close()
    finally:
        for server in servers:
            server.stop()
