"""The reward server: an ASGI app (FastAPI on uvicorn) in front of a pool of verifier processes.

Where things are: this module is the HTTP layer (the endpoints, `create_app`, `serve`, the CLI);
`protocol.py` validates requests and builds answers; `scoring.py` is what a verifier worker runs;
`mmrl/verifier_pool.py` is the pool (time limits, the watchdog, dead workers), shared with the
trainer; `guard.py` the connection caps and authentication; `metrics.py` `/metrics`;
`process.py` a server in a child process; `client.py` the client and `RemoteRouter`.

Design. One server process runs the HTTP event loop; `workers` verifier processes (spawned,
each with the verifiers warmed up) do the scoring. Rather than one request at a time per worker,
the samples of *all* open requests go into one queue, and each worker is sent whatever has
accumulated as one message (up to `max_chunk` samples; two messages in flight per worker so it
never waits for the event loop). Under light load a message holds one sample and latency is the
verifier's own time plus a pipe round trip; under heavy load messages grow and the per-sample
overhead shrinks. (uvicorn's own `--workers` would instead run N copies of the event loop, each
blocked on its own requests, and could not batch across connections.)

Hard time limits. Each worker records in shared memory which sample it is scoring and since when.
A watchdog kills a worker whose current sample has run past `time_limit_s + kill_grace_s` (a
hang inside C code, which the verifier's own timer signal cannot interrupt); a worker that dies
(crash, `os._exit`, segfault) is noticed through its process sentinel. Either way the sample it
was scoring gets an error result, the other samples it held are re-queued, a replacement worker
is spawned, and the server keeps serving.

The endpoints are served by a pure-ASGI app in front of the FastAPI app, outside its middleware
stack (raw `receive`/`send`: for a verifier that takes 0.04 ms, FastAPI's per-request machinery
would cost more than the scoring), with hand-written validation that names the offending field.
With `check_images`, a request's images are decoded in a thread pool (`image_decode_threads`),
never on the event loop, within a per-request pixel budget (`max_request_pixels`).
Accepted sockets get TCP_NODELAY, so a keep-alive response is never held back by Nagle's
algorithm waiting for the client's delayed ACK (~40 ms), and a response's head and body leave in
one write.

Where the CPU goes. On a machine whose cores the workers keep busy, the server's throughput is
the cores divided by the CPU that a response costs all processes, so the work around the
verifier is kept small: workers write each `/score` result's JSON text themselves (the event
loop only joins texts), keep their time-limit timer armed across samples
(`keep_alarm_handler`), and take the queue in messages of up to `max_chunk` samples; the queue
holds spans of requests rather than one entry per sample; and the start-up heap is frozen out
of the garbage collector's way.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mmrl.heap import freeze_heap
from mmrl.server import protocol
from mmrl.server.config import ServeConfig, load_serve_config
from mmrl.server.guard import Authenticator, ConnectionGuard, guarded_protocol, redact_access_log
from mmrl.server.metrics import Metrics
from mmrl.server.protocol import RequestError, WireResult
from mmrl.server.scoring import server_pool
from mmrl.verifier_pool import Busy, VerifierPool

log = logging.getLogger("mmrl.server")

DRAIN_LIMIT = 256 * 1024 * 1024
"""An oversize body is read and discarded up to this size (so the client sees the 413 instead
of a reset connection); beyond it the connection is closed."""

# ---------------------------------------------------------------------------------------------
# The ASGI app


def create_app(cfg: ServeConfig | None = None) -> RewardEndpoints:
    """The ASGI app serving `cfg`: the reward endpoints in front of a FastAPI app (`.app`)
    whose lifespan starts and stops the worker pool.

    The reward endpoints are served by a pure-ASGI app outside FastAPI's middleware stack (raw
    `receive`/`send`, no Request/Response objects: the per-request cost is what limits
    throughput for fast verifiers); any other path, and the lifespan, go to the FastAPI app, so
    routes added with `@create_app(cfg).app.get(...)` work as usual and unknown paths get
    FastAPI's 404/405."""
    from fastapi import FastAPI

    from mmrl.router import import_plugins
    from mmrl.verifiers.registry import verifier_names

    cfg = cfg or ServeConfig()
    cfg.validate()
    import_plugins(cfg.plugins)
    known = frozenset(verifier_names())
    metrics = Metrics()
    pool = server_pool(cfg, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await pool.start()
        freeze_heap()
        log.info(
            "mmrl reward server: %d verifier workers; verifiers: %s", pool.n_workers, ", ".join(sorted(known))
        )
        try:
            yield
        finally:
            await pool.close("the server is shutting down")
            endpoints.decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="mmrl reward server",
        description="mmrl verifiers as a service: native /score, OpenRLHF /get_reward, V-Triune /judge.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    guard = ConnectionGuard(
        cfg.max_connections, cfg.max_connections_per_client, cfg.head_timeout_s, cfg.retry_after_s
    )
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.guard = guard
    endpoints = _Endpoints(cfg, pool, metrics, known, guard)
    return RewardEndpoints(app, endpoints)


class _Endpoints:
    """The handlers: `(body) -> (status, payload)`, payload a JSON-able object, `JSONBody` or
    text bytes; errors are raised as `RequestError`/`Busy`."""

    def __init__(
        self,
        cfg: ServeConfig,
        pool: VerifierPool,
        metrics: Metrics,
        known: frozenset[str],
        guard: ConnectionGuard | None = None,
    ):
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.known = known
        self.guard = guard
        self.decoder = concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.image_decode_threads, thread_name_prefix="mmrl-image-decode"
        )
        """Decodes `check_images` requests' images, off the event loop."""
        # path -> (method, handler, needs the token)
        self.routes: dict[str, tuple[bytes, Callable[[bytes], Awaitable[Any]], bool]] = {
            "/score": (b"POST", self.score, True),
            "/get_reward": (b"POST", self.get_reward, True),
            "/judge": (b"POST", self.judge, True),
            "/health": (b"GET", self.health, False),
            "/ready": (b"GET", self.ready, False),
            "/metrics": (b"GET", self.metrics_text, True),
            "/": (b"GET", self.root, False),
        }

    async def _scored(
        self, batch: protocol.ParsedBatch, rename: Callable[[str], str] = str, answered: int | None = None
    ) -> list[WireResult]:
        """The batch's results; a sample a verifier's `check_sample` refused is a 422 naming its
        field, for the first `answered` items (default all: the rest are only compared)."""
        timeout_s = self.cfg.request_timeout_s
        if batch.timeout_s is not None:
            timeout_s = min(timeout_s, batch.timeout_s)
        job = self.pool.run(batch.items, timeout_s)
        await job.future
        results: list[WireResult] = job.results  # type: ignore[assignment]
        for i, result in enumerate(results):
            # NaN is not JSON: a verifier's non-finite score or component is the sample's error
            # (workers' rendered /score results already refuse them: see render_fields).
            if type(result) is tuple and result[2] is None:
                problem = protocol.unusable_result(result)
                if problem is not None:
                    results[i] = (0.0, {}, problem, result[3], None)
                    self.metrics.errors[(batch.items[i][0][0], "error")] += 1
        problems = []
        for where, result in zip(batch.wheres[:answered], results[:answered]):
            if type(result) is tuple and result[4] is not None:
                field = rename(result[4][0])
                problems.append(f"{where}.{field}: {result[4][1]}" if where else f"{field}: {result[4][1]}")
        if problems:
            unique = list(dict.fromkeys(problems))
            more = f" (and {len(unique) - 5} more)" if len(unique) > 5 else ""
            raise RequestError(422, "; ".join(unique[:5]) + more)
        return results

    async def score(self, body: bytes) -> tuple[int, Any]:
        data = protocol.parse_json(body)
        cfg = self.cfg
        parse = functools.partial(
            protocol.parse_score_request,
            data,
            self.known,
            cfg.max_batch,
            cfg.check_images,
            cfg.image_root,
            cfg.max_request_pixels,
        )
        if cfg.check_images and protocol.has_images(data):
            # Decoding images takes up to seconds: in a thread, so the event loop keeps serving.
            batch = await asyncio.get_running_loop().run_in_executor(self.decoder, parse)
        else:
            batch = parse()
        return 200, JSONBody(protocol.score_response_json(batch.ids, await self._scored(batch)))

    async def get_reward(self, body: bytes) -> tuple[int, Any]:
        data = protocol.parse_json(body)
        cfg = self.cfg
        batch = protocol.parse_get_reward(
            data, self.known, cfg.max_batch, cfg.label_mode, cfg.default_verifier
        )
        return 200, protocol.get_reward_json(await self._scored(batch))

    async def judge(self, body: bytes) -> tuple[int, Any]:
        # V-Triune's trainer reads every answer's rewards and stops on a 4xx: a sample that
        # cannot be scored gets 200, zeros and an error, counted and logged (never a silent 0).
        data: Any = None
        try:
            data = protocol.parse_json(body)
            batch = protocol.parse_judge(
                data,
                self.known,
                self.cfg.judge_format_ratio,
                self.cfg.judge_iou_threshold,
                self.cfg.judge_math,
            )
            results = await self._scored(batch, protocol.judge_field, answered=1)
        except RequestError as exc:
            verifier = data.get("reward_verifier") if isinstance(data, dict) else None
            self.metrics.sample_done(str(verifier or "unknown"), "invalid")
            log.warning("/judge could not score a sample (%d): %s", exc.status, exc.message)
            return 200, protocol.judge_failure_json(data, exc.message)
        if type(results[0]) is tuple and results[0][2] is not None:
            log.warning("/judge verifier error: %s", results[0][2])
        disagree = protocol.judge_math_disagreement(results)
        if disagree is not None:  # judge_math=mmrl: mmrl's math verifier vs V-Triune's settings
            self.metrics.judge_math_compared += 1
            self.metrics.judge_math_disagreed += disagree
            m = self.metrics
            if disagree and m.judge_math_disagreed % 100 == 1:
                log.info(
                    "/judge math: mmrl's verifier and V-Triune's settings disagree on %d of %d samples "
                    "so far (this one: mmrl %s, V-Triune %s; response %.80r)",
                    m.judge_math_disagreed,
                    m.judge_math_compared,
                    results[0][1].get("accuracy"),
                    results[1][1].get("accuracy"),
                    batch.items[0][1],
                )
        return 200, protocol.judge_json(results[0], batch.items[0][0][0])

    async def health(self, body: bytes) -> tuple[int, Any]:
        return 200, {"status": "ok"}

    async def ready(self, body: bytes) -> tuple[int, Any]:
        n = self.pool.ready_workers
        return 200 if n > 0 else 503, {
            "ready": n > 0,
            "workers_ready": n,
            "workers": self.pool.n_workers,
            "pending": self.pool.pending,
            "verifiers": sorted(self.known),
            "max_batch": self.cfg.max_batch,
        }

    async def metrics_text(self, body: bytes) -> tuple[int, Any]:
        text = self.metrics.render(self.pool)
        if self.guard is not None:
            text += self.guard.render() + "\n"
        return 200, text.encode()

    async def root(self, body: bytes) -> tuple[int, Any]:
        # V-Triune's client checks for this exact message before it sends anything to /judge.
        return 200, {
            "message": "Reward Judge Server",
            "server": "mmrl",
            "endpoints": ["/score", "/get_reward", "/judge", "/health", "/ready", "/metrics"],
        }


class JSONBody(bytes):
    """A handler's answer that is JSON text already."""


_JSON = [(b"content-type", b"application/json")]
_TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


class RewardEndpoints:
    """Pure-ASGI app serving `_Endpoints.routes`; everything else (other paths, the lifespan)
    goes to `app`."""

    def __init__(self, app: Any, endpoints: _Endpoints):
        self.app = app
        self.endpoints = endpoints
        self.cfg = endpoints.cfg
        self.auth = Authenticator(self.cfg.token, self.cfg.query_token, self.cfg.allow_networks)
        self.guard = endpoints.guard
        self.refused: collections.Counter[int] = collections.Counter()
        """Requests refused for configuration reasons (401, 403, 413) or a body that did not
        arrive in time (408), by status."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        route = self.endpoints.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if route is None or scope["method"].encode() != route[0]:
            await self.app(scope, receive, send)
            return
        _, handler, needs_token = route
        start = time.perf_counter()
        extra: list[tuple[bytes, bytes]] = []
        try:
            headers = dict(scope["headers"])
            if needs_token:
                self.auth.check(scope, headers.get(b"authorization"))
            body = (
                await self._read_body_in_time(headers.get(b"content-length"), receive)
                if route[0] == b"POST"
                else b""
            )
            status, payload = await handler(body)
        except RequestError as exc:
            status, payload = exc.status, {"detail": exc.message}
            if exc.status == 401:
                extra = [(b"www-authenticate", b"Bearer")]
            elif exc.status in (408, 413):
                extra = [(b"connection", b"close")]
            if exc.status in (401, 403, 408, 413):
                # Clients such as V-Triune's cannot survive these: say why on the server's side
                # too (the first of each kind, then every 1000th, so a flood cannot fill the log).
                self.refused[exc.status] += 1
                if self.refused[exc.status] % 1000 == 1:
                    log.warning(
                        "%s refused with %d (%d so far): %s",
                        scope.get("path"),
                        exc.status,
                        self.refused[exc.status],
                        exc.message,
                    )
        except Busy as exc:
            retry = self.cfg.retry_after_s
            status, payload = 429, {"detail": f"server busy: {exc}; retry after {retry}s"}
            extra = [(b"retry-after", str(retry).encode())]
        except Exception as exc:  # noqa: BLE001 - a server bug: say so, keep serving
            log.exception("internal error in %s", scope["path"])
            status, payload = 500, {"detail": f"internal error: {type(exc).__name__}: {exc}"}
        if status == 503:  # /ready before a worker is warm
            extra = [*extra, (b"retry-after", str(self.cfg.retry_after_s).encode())]
        if isinstance(payload, JSONBody):
            body, kind = payload, _JSON
        elif isinstance(payload, bytes):
            body, kind = payload, _TEXT
        else:
            body, kind = json.dumps(payload, separators=(",", ":")).encode(), _JSON
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*kind, (b"content-length", str(len(body)).encode()), *extra],
            }
        )
        await send({"type": "http.response.body", "body": body})
        self.endpoints.metrics.request_done(scope["path"], status, time.perf_counter() - start)

    async def _read_body_in_time(self, length: bytes | None, receive: Callable) -> bytes:
        """`_read_body` within `body_timeout_s` of the head, all of it (a body that trickles in
        gets no more time than one that never comes); past it, a 408 (sent with `Connection:
        close`, so the connection is closed and its place freed)."""
        task = asyncio.current_task()
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.cfg.body_timeout_s, expire)
        try:
            return await self._read_body(length, receive)
        except asyncio.CancelledError:
            if not timed_out:
                raise
            if hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()
            raise RequestError(
                408,
                f"the request body did not arrive within {self.cfg.body_timeout_s:g}s of its head "
                "(this server's body_timeout_s); the connection is closed",
            ) from None
        finally:
            timer.cancel()

    async def _read_body(self, length: bytes | None, receive: Callable) -> bytes:
        limit = self.cfg.max_body_bytes
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise RequestError(
                    400, f"invalid Content-Length header {length.decode(errors='replace')!r}"
                ) from None
            if declared > limit:
                await self._drain(receive, declared)
                raise RequestError(
                    413, f"request body of {declared} bytes exceeds this server's limit of {limit} bytes"
                )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError(400, "the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if message.get("more_body"):
                    await self._drain(receive, None)
                raise RequestError(413, f"request body exceeds this server's limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @staticmethod
    async def _drain(receive: Callable, declared: int | None) -> None:
        """Read and discard the rest of an oversize body so the client sees the 413."""
        if declared is not None and declared > DRAIN_LIMIT:
            return
        seen = 0
        while seen <= DRAIN_LIMIT:
            message = await receive()
            seen += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return


# ---------------------------------------------------------------------------------------------
# Running it


class _CoalescingTransport:
    """A transport whose writes made in one turn of the event loop go out as one write at the
    end of it: uvicorn writes a response's head and body separately, which with TCP_NODELAY
    would be two segments (two system calls, and two wake-ups of the client)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _nodelay_protocol():
    """uvicorn's HTTP protocol with TCP_NODELAY set on every accepted socket, and the writes
    of one loop turn coalesced (`_CoalescingTransport`)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(_CoalescingTransport(transport, asyncio.get_running_loop()))

    return NoDelayHTTPProtocol


def serve(cfg: ServeConfig) -> None:
    """Run the server in this process until interrupted."""
    import uvicorn

    cfg.validate()
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    app = create_app(cfg)
    config = uvicorn.Config(
        app,
        host=cfg.bind_address(),
        port=cfg.port,
        # Connection caps (503 with Retry-After) and the request-head time limit: mmrl.server.guard.
        http=guarded_protocol(_nodelay_protocol(), app.guard),
        lifespan="on",
        log_level=cfg.log_level,
        access_log=cfg.access_log,
        timeout_keep_alive=int(math.ceil(cfg.keep_alive_s)),
        limit_concurrency=None,  # the guard's caps replace it (uvicorn's 503 has no Retry-After)
        server_header=False,
        # The endpoints never look at the client's address: skip rewriting it from
        # X-Forwarded-For on every request.
        proxy_headers=False,
    )
    redact_access_log()  # after uvicorn.Config, which configures its loggers
    uvicorn.Server(config).run()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `mmrl serve` (every other setting lives in the `--config` file)."""
    parser.add_argument(
        "--host", default=None, help="address to bind (default 127.0.0.1; others need a token)"
    )
    parser.add_argument("--port", type=int, default=None, help="TCP port (default 8000)")
    parser.add_argument(
        "--workers", type=int, default=None, help="verifier worker processes (default: one per CPU core)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML file with ServeConfig fields (mmrl.server.config)",
    )


def run_serve_command(args: argparse.Namespace) -> int:
    """`mmrl serve`: load the config (file, then flags), refuse unsafe settings, serve."""
    try:
        cfg = load_serve_config(args.config, {"host": args.host, "port": args.port, "workers": args.workers})
    except (ValueError, FileNotFoundError) as exc:
        print(f"mmrl serve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - OmegaConf's errors (unknown key, wrong type) name the key
        print(f"mmrl serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    serve(cfg)
    return 0
