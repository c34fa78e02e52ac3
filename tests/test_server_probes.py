"""Issue 48, items 11-14: the reward server's defects found by probing. Only image formats
that mmrl allows are opened (item 14); image decoding runs off the event loop within a
per-request pixel budget (item 13); a client that sends headers and then no body is
disconnected (item 12); a request's time-out cancels its work, killing and replacing the
workers that still run its samples (item 11)."""

from __future__ import annotations

import base64
import contextlib
import io
from pathlib import Path

import pytest
from PIL import Image

from mmrl.server.protocol import RequestError, check_image
from mmrl.types import ALLOWED_IMAGE_FORMATS, ImageError, load_image

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n"


def _encoded(fmt: str, size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Item 14: only PNG, JPEG, WebP, GIF, BMP and TIFF are opened


def test_the_allowed_formats_are_png_jpeg_webp_gif_bmp_tiff():
    assert set(ALLOWED_IMAGE_FORMATS) == {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_allowed_formats_load_from_bytes_and_paths(fmt, tmp_path):
    data = _encoded(fmt)
    assert load_image(data).size == (8, 8)
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(data)
    assert load_image(path).mode == "RGB"


def test_eps_is_refused_naming_its_format_and_never_reaches_ghostscript(tmp_path, monkeypatch):
    from PIL import EpsImagePlugin

    def no_ghostscript(*args, **kwargs):
        raise AssertionError("Ghostscript was asked to render untrusted data")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    with pytest.raises(ImageError, match=r"EPS images are not accepted \(allowed formats: PNG, JPEG, WebP"):
        load_image(EPS)
    path = tmp_path / "picture.png"  # the name does not matter, the bytes do
    path.write_bytes(EPS)
    with pytest.raises(ImageError, match="picture.png: EPS images are not accepted"):
        load_image(path)


@pytest.mark.parametrize("fmt", ["PPM", "ICO", "PCX", "SGI", "DDS"])
def test_other_formats_pillow_knows_are_refused_by_name(fmt):
    with pytest.raises(ImageError, match=f"{fmt} images are not accepted"):
        load_image(_encoded(fmt))


def test_the_server_refuses_an_eps_image_with_a_422_naming_the_format(tmp_path):
    for item in (
        base64.b64encode(EPS).decode(),
        "data:image/png;base64," + base64.b64encode(EPS).decode(),
    ):
        with pytest.raises(RequestError) as info:
            check_image(item, "samples[0].images[0]", decode=True)
        assert info.value.status == 422
        assert "samples[0].images[0]: unreadable image" in info.value.message
        assert "EPS images are not accepted" in info.value.message
    (tmp_path / "a.eps").write_bytes(EPS)
    with pytest.raises(RequestError, match="a.eps: EPS images are not accepted"):
        check_image("a.eps", "samples[0].images[0]", decode=True, image_root=tmp_path)


# ---------------------------------------------------------------------------------------------
# Item 13: images are decoded off the event loop, within a per-request pixel budget


async def _asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request through the ASGI app in this process: (status, JSON answer)."""
    import json

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 40000),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


def _image_request(n_images: int = 1, size: tuple[int, int] = (8, 8)) -> bytes:
    import json

    image = base64.b64encode(_encoded("PNG", size)).decode()
    sample = {"images": [image] * n_images, "reward_model": {"verifier": "math", "ground_truth": "3"}}
    return json.dumps({"samples": [sample], "responses": ["\\boxed{3}"]}).encode()


def test_health_answers_while_a_request_s_images_are_being_decoded(monkeypatch):
    import asyncio
    import threading

    import mmrl.types
    from mmrl.server.app import create_app
    from mmrl.server.config import ServeConfig

    real_load_image = mmrl.types.load_image
    decoding = threading.Event()
    release = threading.Event()
    state = {"finished": False, "on_loop_thread": None}

    def slow_load_image(src, **kwargs):
        state["on_loop_thread"] = threading.current_thread() is threading.main_thread()
        decoding.set()
        release.wait(30)  # the test releases it once /health has answered
        image = real_load_image(src, **kwargs)
        state["finished"] = True
        return image

    monkeypatch.setattr(mmrl.types, "load_image", slow_load_image)
    app = create_app(ServeConfig(workers=1, check_images=True))
    pool = app.endpoints.pool

    async def main() -> None:
        await pool.start()
        try:
            await pool.wait_ready()
            score = asyncio.ensure_future(_asgi(app, "POST", "/score", _image_request()))
            assert await asyncio.get_running_loop().run_in_executor(None, decoding.wait, 30)
            status, answer = await asyncio.wait_for(_asgi(app, "GET", "/health"), 30)
            assert (status, answer) == (200, {"status": "ok"})
            assert not state["finished"]  # /health answered while the decode was still held
            release.set()
            status, answer = await score
            assert status == 200 and answer["results"][0]["score"] == 1.0
        finally:
            release.set()
            await pool.close()
            app.endpoints.decoder.shutdown()

    asyncio.run(main())
    assert state["on_loop_thread"] is False


def test_a_request_s_images_past_the_pixel_budget_are_a_413_before_decoding(monkeypatch):
    from mmrl.server.protocol import parse_json, parse_score_request
    from mmrl.verifiers import verifier_names

    known = frozenset(verifier_names())
    body = parse_json(_image_request(n_images=5, size=(100, 100)))  # 50,000 pixels in all
    assert len(parse_score_request(body, known, 8, True, None, 50_000).items) == 1
    from PIL import ImageFile

    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(
        ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real_load(self)
    )
    with pytest.raises(RequestError) as info:
        parse_score_request(body, known, 8, True, None, 49_999)
    assert info.value.status == 413
    assert info.value.message.startswith("samples[0].images[4]: the request's images hold more than 49,999")
    assert "max_request_pixels" in info.value.message
    assert len(decoded) == 4  # the fifth image was refused from its header, never decoded
    # Without check_images nothing is decoded, so nothing is counted.
    assert len(parse_score_request(body, known, 8, False, None, 1).items) == 1


def test_the_server_s_pixel_budget_and_decode_threads_are_validated():
    from mmrl.server.config import ServeConfig

    assert ServeConfig().max_request_pixels == 256_000_000
    for name in ("max_request_pixels", "image_decode_threads"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            ServeConfig(**{name: 0}).validate()


# ---------------------------------------------------------------------------------------------
# Item 12: a request body that never comes (or trickles in) is cut off after body_timeout_s

WAIT_S = 60.0
"""Upper bound for waiting on the server (a hang guard that marks failure, not a speed limit)."""


def _read_until_closed(sock) -> bytes:
    sock.settimeout(WAIT_S)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_connections_that_send_headers_and_no_body_are_closed_and_free_their_place():
    import socket
    import threading

    import httpx

    from mmrl.server.config import ServeConfig
    from mmrl.server.process import start_server_process

    cfg = ServeConfig(
        port=0,
        workers=1,
        max_connections=4,
        max_connections_per_client=4,
        head_timeout_s=30.0,  # the heads arrive at once: the body limit, not the head limit, closes them
        keep_alive_s=60.0,
        body_timeout_s=1.0,
    )
    head = (
        b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with start_server_process(cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        sockets = []
        for _ in range(cfg.max_connections):  # every place the server has
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head)
            sockets.append(sock)
        stop = threading.Event()

        def trickle(sock) -> None:  # the last one sends a byte every 0.1 s: no more time for that
            with contextlib.suppress(OSError):
                while not stop.wait(0.1):
                    # Until the answer is in: a byte reaching the server after it closed the
                    # connection makes its kernel reset it, which discards the unread answer here.
                    with contextlib.suppress(BlockingIOError):
                        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                            return
                    sock.sendall(b" ")

        thread = threading.Thread(target=trickle, args=(sockets[-1],), daemon=True)
        thread.start()
        try:
            answers = [_read_until_closed(sock) for sock in sockets]
        finally:
            stop.set()
            thread.join()
            for sock in sockets:
                sock.close()
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert b"body_timeout_s" in answer
            assert b"connection: close" in answer.lower()
        # Their places are free again: another client is served.
        body = {
            "samples": [{"reward_model": {"verifier": "math", "ground_truth": "3"}}],
            "responses": ["\\boxed{3}"],
        }
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            answer = client.post("/score", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["results"][0]["score"] == 1.0


def test_body_timeout_must_be_positive():
    from mmrl.server.config import ServeConfig

    assert ServeConfig().body_timeout_s == 30.0
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        ServeConfig(body_timeout_s=0).validate()


# ---------------------------------------------------------------------------------------------
# Item 11: a request's time-out cancels its work, so it cannot keep the pool busy


def test_a_timed_out_request_s_workers_are_killed_and_replaced_so_the_next_client_is_served(
    tmp_path, monkeypatch
):
    """Six answers that never finish by themselves (the `fault` verifier's `pid:` mode waits
    for a file this test creates only at the end) and `timeout_s` 1: the request comes back
    with time-out errors, its two busy workers are killed and replaced, and another client's
    request is then scored (before the fix, the workers stayed busy with the dead request)."""
    import asyncio
    import json

    from mmrl.server.app import create_app
    from mmrl.server.config import ServeConfig

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))  # workers inherit sys.path
    app = create_app(
        ServeConfig(workers=2, time_limit_s=600.0, request_timeout_s=600.0, plugins=["fault_verifiers"])
    )
    pool = app.endpoints.pool
    slow = json.dumps(
        {
            "samples": [{"reward_model": {"verifier": "fault", "ground_truth": "1"}}],
            "responses": [f"pid:{tmp_path / f'busy{i}'}" for i in range(6)],
            "sample_index": [0] * 6,
            "timeout_s": 1.0,
        }
    ).encode()
    normal = json.dumps(
        {
            "samples": [{"reward_model": {"verifier": "math", "ground_truth": "3"}}],
            "responses": ["\\boxed{3}"],
        }
    ).encode()

    async def main() -> None:
        await pool.start()
        try:
            await pool.wait_ready()
            before = set(pool.worker_pids())
            status, answer = await asyncio.wait_for(_asgi(app, "POST", "/score", slow), WAIT_S)
            assert status == 200
            assert [r["error"] for r in answer["results"]] == [
                "timeout: the request's 1s limit passed before this sample was scored"
            ] * 6
            assert answer["errors"] == 6
            # Both workers held the request's samples (the idle pool split them): both replaced.
            assert pool.cancelled_workers == 2
            # Another client: scored, not failed or left waiting behind the abandoned samples
            # (WAIT_S only marks a hang as a failure).
            status, answer = await asyncio.wait_for(_asgi(app, "POST", "/score", normal), WAIT_S)
            assert status == 200, answer
            assert answer["results"][0]["score"] == 1.0 and answer["results"][0]["error"] is None
            after = set(pool.worker_pids())
            assert len(after) == 2 and after.isdisjoint(before)
            assert pool.restarts == 2
            assert pool.pending == 0 and pool.queued == 0  # nothing of the dead request is left
        finally:
            for i in range(6):
                (tmp_path / f"busy{i}.go").touch()
            await pool.close()
            app.endpoints.decoder.shutdown()

    asyncio.run(main())
