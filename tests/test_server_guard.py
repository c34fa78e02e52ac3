"""The reward server's connection and request guards, against a real server process on loopback
addresses with small limits: idle and trickling connections (a bounded flood: 300 sockets),
connection caps answered with 503 + Retry-After, the token in the URL's query string (never
printed by the access log), client networks allowed without a token, and `--host [::1]`.

Every 127.0.0.0/8 address is this machine's, so clients bind 127.0.0.2, 127.0.0.3, ... to be
"other client addresses" for the per-client cap and the network allow-list.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import subprocess
import sys
import time

import httpx
import pytest

from mmrl.server.config import ServeConfig
from mmrl.server.process import start_server_process

TOKEN = "guard-token-0123456789"
PER_CLIENT = 16
IDLE_SOCKETS = 300
WAIT_S = 120.0
"""Upper bound for waiting on the server to close a connection (a hang guard, not a limit on
how fast it must be: the server closes them after `head_timeout_s`)."""


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(
        port=0,
        workers=1,
        token=TOKEN,
        max_connections=64,
        max_connections_per_client=PER_CLIENT,
        head_timeout_s=2.0,
        keep_alive_s=60.0,  # longer than the head limit: the guard, not keep-alive, closes them
        allow_networks=["127.0.0.3/32"],
        access_log=True,
    )
    with start_server_process(cfg, env={"PYTHONUNBUFFERED": "1"}) as proc:
        yield proc


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _connect(server, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", _port(server)))
    return sock


def _request(sock: socket.socket, path: str = "/health") -> bytes:
    """Send a GET and read one response (head and a Content-Length body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(WAIT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _wait_closed(socks: list[socket.socket]) -> list[socket.socket]:
    """Wait (at most WAIT_S) for the server to close each socket; the ones still open."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    open_ = set(socks)
    deadline = time.monotonic() + WAIT_S
    while open_ and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(sock)
                open_.discard(sock)
    selector.close()
    return list(open_)


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        yield c


def _score_body() -> dict:
    return {
        "samples": [{"reward_model": {"ground_truth": "2", "verifier": "math"}}],
        "responses": ["\\boxed{2}"],
    }


def test_idle_connections_neither_lock_other_clients_out_nor_stay_open(server, http):
    idle = [_connect(server, "127.0.0.2") for _ in range(IDLE_SOCKETS)]
    try:
        # 300 silent sockets, far past max_connections (64): another client is still served.
        answer = http.post("/score", json=_score_body())
        assert answer.status_code == 200, answer.text
        assert answer.json()["results"][0]["score"] == 1.0
        assert http.get("/health").status_code == 200
        # ...and every idle socket is closed by the server (after head_timeout_s).
        still_open = _wait_closed(idle)
        assert not still_open, f"{len(still_open)} of {IDLE_SOCKETS} idle connections were never closed"
        assert _metric(http, "mmrl_head_timeouts_total") >= IDLE_SOCKETS
        assert _metric(http, "mmrl_connections_refused_total") >= IDLE_SOCKETS - PER_CLIENT
    finally:
        for sock in idle:
            sock.close()


def test_a_request_head_that_trickles_in_is_cut_off_on_a_new_and_a_kept_alive_connection(server):
    fresh = _connect(server, "127.0.0.5")
    kept = _connect(server, "127.0.0.5")
    try:
        fresh.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest of the head
        assert b" 200 " in _request(kept).split(b"\r\n")[0]
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request's head, unfinished
        assert not _wait_closed([fresh, kept])
    finally:
        fresh.close()
        kept.close()


def test_connections_over_the_per_client_cap_get_503_with_retry_after(server, http):
    socks = []
    try:
        for _ in range(PER_CLIENT):
            sock = _connect(server, "127.0.0.4")
            socks.append(sock)
            assert _request(sock).startswith(b"HTTP/1.1 200 ")  # admitted, and kept alive
        extra = _connect(server, "127.0.0.4")
        socks.append(extra)
        answer = _request(extra)
        head = answer.split(b"\r\n\r\n")[0].decode().lower()
        assert head.startswith("http/1.1 503 "), answer
        assert "retry-after: 1" in head and "connection: close" in head
        assert b"too many open connections from 127.0.0.4" in answer
        # Other addresses are not affected.
        assert http.get("/health").status_code == 200
    finally:
        for sock in socks:
            sock.close()


def test_the_token_may_come_in_the_query_string_and_the_access_log_never_shows_it(server):
    body = {"query": ["\\boxed{2}"], "labels": ["2"]}
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        answer = anonymous.post(f"/get_reward?token={TOKEN}", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["rewards"] == [1.0]
        wrong = anonymous.post("/get_reward?token=nope", json=body)
        assert wrong.status_code == 401 and "invalid token" in wrong.json()["detail"]
        missing = anonymous.post("/get_reward", json=body)
        assert missing.status_code == 401 and "?token=<token>" in missing.json()["detail"]
    deadline = time.monotonic() + WAIT_S
    while "/get_reward?token=***" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log_text()
    assert "/get_reward?token=***" in log
    assert TOKEN not in log


def test_clients_in_allow_networks_need_no_token_and_others_still_do(server):
    body = {"query": ["\\boxed{2}"], "labels": ["2"]}
    allowed = httpx.HTTPTransport(local_address="127.0.0.3")
    with httpx.Client(base_url=server.url, transport=allowed, timeout=60) as client:
        answer = client.post("/get_reward", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["rewards"] == [1.0]
        judge = client.post(
            "/judge",
            json={"response": "\\boxed{2}", "solution": "2", "reward_verifier": "mathverify"},
        )
        assert judge.status_code == 200 and judge.json()["error"] is None
    with httpx.Client(base_url=server.url, timeout=60) as other:
        assert other.post("/get_reward", json=body).status_code == 401
    # Refusals are in the server's own log too, with their reason (clients such as V-Triune's
    # only see their retries fail): the first of each status (this server's first 401 may have
    # come from another test sharing it), then every 1000th.
    deadline = time.monotonic() + WAIT_S
    while "refused with 401 (1 so far)" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    first = [line for line in server.log_text().splitlines() if "refused with 401" in line]
    assert len(first) == 1 and "(1 so far)" in first[0] and "token" in first[0], first


def test_allow_networks_without_a_token_may_bind_beyond_loopback_and_refuses_other_addresses():
    from mmrl.server.guard import Authenticator
    from mmrl.server.protocol import RequestError

    cfg = ServeConfig(host="0.0.0.0", allow_networks=["10.0.0.0/8", "fd00::/8"])
    cfg.validate()  # no token needed: only the listed networks are served
    with pytest.raises(ValueError, match="allow_networks\\[0\\]"):
        ServeConfig(allow_networks=["10.0.0.300/8"]).validate()
    auth = Authenticator(None, True, cfg.allow_networks)
    auth.check({"client": ("10.1.2.3", 5)}, None)
    auth.check({"client": ("::ffff:10.1.2.3", 5)}, None)  # IPv4 on a dual-stack socket
    auth.check({"client": ("fd00::1", 5)}, None)
    with pytest.raises(RequestError) as refused:
        auth.check({"client": ("192.168.0.1", 5)}, None)
    assert refused.value.status == 403 and "192.168.0.1" in refused.value.message


def test_access_log_redaction_covers_every_token_parameter():
    from mmrl.server.guard import redact

    line = '127.0.0.1:5 - "POST /judge?a=1&token=s3cr%2Bt&TOKEN=x HTTP/1.1" 200'
    assert redact(line) == '127.0.0.1:5 - "POST /judge?a=1&token=***&TOKEN=*** HTTP/1.1" 200'


def test_host_given_as_a_bracketed_ipv6_literal_is_served(tmp_path):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    code = "import sys; from mmrl.server import main; sys.exit(main(sys.argv[1:]))"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--host", "[::1]", "--port", str(port), "--workers", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MMRL_SERVE_TOKEN": ""},
        )
    try:
        deadline = time.monotonic() + 180
        status = None
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(f"http://[::1]:{port}/health", timeout=2).status_code
                if status == 200:
                    break
            time.sleep(0.2)
        assert status == 200, f"exit code {proc.poll()}:\n{log_path.read_text()}"
        assert json.loads(httpx.get(f"http://[::1]:{port}/").text)["message"] == "Reward Judge Server"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_ready_answers_503_with_retry_after_until_a_worker_is_warm():
    import asyncio

    from mmrl.server.app import create_app

    app = create_app(ServeConfig(workers=1, retry_after_s=3))  # its pool is not started: no worker
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/ready", "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 503
    assert (b"retry-after", b"3") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["ready"] is False
