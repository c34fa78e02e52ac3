"""The reward server: an ASGI app (FastAPI on uvicorn) in front of a pool of verifier processes.

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
import bisect
import contextlib
import functools
import gc
import json
import logging
import math
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from mmrl.server import protocol
from mmrl.server.config import ServeConfig, load_serve_config
from mmrl.server.guard import Authenticator, ConnectionGuard, guarded_protocol, redact_access_log
from mmrl.server.protocol import RequestError, WireItem, WireResult
from mmrl.types import VerifyContext
from mmrl.verifiers.registry import VerifierTimeout, call_with_time_limit, get_verifier, keep_alarm_handler

log = logging.getLogger("mmrl.server")

PIPELINE_DEPTH = 2
"""Messages in flight per worker: the next one is already in its pipe when it finishes one."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the request-latency histogram."""
DRAIN_LIMIT = 256 * 1024 * 1024
"""An oversize body is read and discarded up to this size (so the client sees the 413 instead
of a reset connection); beyond it the connection is closed."""
WATCHDOG_PERIOD_S = 0.05
"""How often worker progress is checked against the hard time limit."""
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


# ---------------------------------------------------------------------------------------------
# The worker process


def _worker_main(
    inbox, outbox, progress, plugins: tuple[str, ...], time_limit_s: float, cache_size: int
) -> None:
    """Score chunks of `WireItem`s until the server closes the pipe.

    `progress` is shared memory `[chunk seq, item index, start time]` (start time 0 when idle),
    written before each sample so the server knows what a stuck or dead worker was doing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    from mmrl.router import import_plugins
    from mmrl.verifiers.registry import warm_up_verifiers

    import_plugins(plugins)
    warm_up_verifiers()
    _freeze_heap()
    outbox.send_bytes(pickle.dumps(("ready", os.getpid())))
    checked: OrderedDict = OrderedDict()
    with keep_alarm_handler():  # this process only scores: the timer is armed only when needed
        while True:
            try:
                data = inbox.recv_bytes()
            except (EOFError, OSError):
                return
            seq, items = pickle.loads(data)
            out = []
            samples: dict = {}
            for k, item in enumerate(items):
                progress[0] = seq
                progress[1] = k
                progress[2] = time.monotonic()
                out.append(_score_item(item, checked, cache_size, time_limit_s, samples))
            progress[2] = 0.0
            outbox.send_bytes(pickle.dumps((seq, out), protocol=pickle.HIGHEST_PROTOCOL))


def _freeze_heap() -> None:
    """Move everything allocated so far (modules, verifiers' caches) out of the garbage
    collector's view: the full collections that the per-request garbage triggers would
    otherwise walk that whole heap again and again."""
    gc.collect()
    gc.freeze()


def _score_item(
    item: WireItem, checked: OrderedDict, cache_size: int, time_limit_s: float, samples: dict
) -> WireResult:
    """Score one item: the verifier's `check_sample` (remembered per ground truth and params),
    then the verifier under the time limit; any exception is the item's error result.

    `samples` (one chunk's): the responses of one sample share its fields tuple (pickle keeps
    that sharing within a chunk), so its `Sample` is built, and checked, once per chunk; so is
    each `VerifyContext` (keyed by (step, total_steps))."""
    try:
        fields = item[0]
        # Keyed by the shared tuple's identity: every item of the chunk is alive, so no two
        # distinct tuples can have the same key.
        known = samples.get(id(fields))
        if known is not None:
            sample, verifier, problem = known
        else:
            sample = protocol.fields_sample(fields)
            verifier = get_verifier(sample.reward_model.verifier)
            key = (fields[0], repr(fields[1]), repr(fields[2]))
            problem = checked.get(key, False)
            if problem is False:
                try:
                    call_with_time_limit(lambda: verifier.check_sample(sample), time_limit_s)
                    problem = None
                except VerifierTimeout:
                    return (0.0, {}, f"timeout: checking the sample ran past {time_limit_s:g}s", None, None)
                except ValueError as exc:
                    problem = (getattr(exc, "field", "reward_model.ground_truth"), str(exc))
                checked[key] = problem
                if len(checked) > cache_size:
                    checked.popitem(last=False)
            samples[id(fields)] = (sample, verifier, problem)
        if problem is not None:
            field, message = problem
            return (0.0, {}, f"invalid sample: field '{field}': {message}", None, problem)
        _, response, step, total_steps, native = item
        context = samples.get((step, total_steps))
        if context is None:
            context = samples[(step, total_steps)] = VerifyContext(step, total_steps)
        result = verifier(response, sample, context, time_limit_s=time_limit_s)
        if native and result.error is None:
            return protocol.render_fields(float(result.score), result.components, result.extracted)
        components = {str(k): _number(v) for k, v in result.components.items()}
        extracted = None if result.extracted is None else str(result.extracted)
        return (float(result.score), components, result.error, extracted, None)
    except Exception as exc:  # noqa: BLE001 - a bug anywhere is this sample's error, not the worker's end
        return (0.0, {}, f"{type(exc).__name__}: {exc}", None, None)


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


# ---------------------------------------------------------------------------------------------
# The pool of workers and the queue in front of it


class Busy(Exception):
    """Accepting the request would exceed `max_pending`."""


class Job:
    """The items of one request and their results."""

    __slots__ = ("items", "results", "remaining", "future", "done", "timer")

    def __init__(self, items: list[WireItem], future: asyncio.Future):
        self.items = items
        self.results: list[WireResult | None] = [None] * len(items)
        self.remaining = len(items)
        self.future = future
        self.done = False
        self.timer: asyncio.TimerHandle | None = None

    def set(self, index: int, result: WireResult) -> bool:
        """Record one result; False if the job already had one (or timed out)."""
        return self.results[index] is None and self.fill(index, [result])

    def fill(self, start: int, results: list[WireResult]) -> bool:
        """Record the results of items `start, start + 1, ...`, none of which has one yet
        (each item is sent to a worker once, or again only after a worker died without
        answering for it); False if the job is already done (timed out)."""
        if self.done:
            return False
        self.results[start : start + len(results)] = results
        self.remaining -= len(results)
        if self.remaining == 0:
            self.finish()
        return True

    def finish(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            self.future.set_result(None)


class _Reader(asyncio.Protocol):
    """Reassembles the worker's `Connection.send_bytes` frames."""

    def __init__(self, on_frame: Callable[[bytes], None]):
        self.on_frame = on_frame
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        pos = 0
        while True:
            if len(buf) - pos < 4:
                break
            (n,) = _HEADER.unpack_from(buf, pos)
            start = pos + 4
            if n == -1:
                if len(buf) - start < 8:
                    break
                (n,) = _LONG_HEADER.unpack_from(buf, start)
                start += 8
            if len(buf) - start < n:
                break
            self.on_frame(bytes(buf[start : start + n]))
            pos = start + n
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # the process sentinel reports the worker's end


def _span_items(spans: list[Span]) -> list[WireItem]:
    if len(spans) == 1:
        job, start, end = spans[0]
        return job.items[start:end]
    items: list[WireItem] = []
    for job, start, end in spans:
        items += job.items[start:end]
    return items


def _take_back(
    chunks: dict[int, tuple[list[Span], int]], blamed: tuple[int, int] | None
) -> tuple[list[Span], tuple[Job, int] | None]:
    """What a dead worker held: the spans to queue again, and `(job, item)` of the one it was
    scoring (`blamed`: (message seq, index in the message)), which is left out of them."""
    requeue: list[Span] = []
    culprit = None
    for seq, (spans, _) in chunks.items():
        offset = 0
        for job, start, end in spans:
            item = start + blamed[1] - offset if blamed is not None and seq == blamed[0] else -1
            offset += end - start
            if start <= item < end:
                culprit = (job, item)
                requeue += [span for span in ([job, start, item], [job, item + 1, end]) if span[1] < span[2]]
            else:
                requeue.append([job, start, end])
    return requeue, culprit


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    if n > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _LONG_HEADER.pack(n) + payload
    return _HEADER.pack(n) + payload


Span = list
"""`[job, start, end]`: items `start:end` of a job, queued or sent to a worker together."""


class _Worker:
    __slots__ = (
        "slot",
        "proc",
        "progress",
        "writer",
        "reader",
        "ready",
        "dead",
        "chunks",
        "n_items",
        "kill_reason",
    )

    def __init__(self, slot: int):
        self.slot = slot
        self.proc: Any = None
        self.progress: Any = None
        self.writer: asyncio.WriteTransport | None = None
        self.reader: asyncio.ReadTransport | None = None
        self.ready = False
        self.dead = False
        self.chunks: dict[int, tuple[list[Span], int]] = {}
        """In flight: message seq -> (its spans, its item count)."""
        self.n_items = 0
        self.kill_reason: str | None = None


class WorkerPool:
    """Verifier worker processes fed from one queue (see the module docstring)."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.n_workers = cfg.resolved_workers()
        self.ctx = multiprocessing.get_context("spawn")
        self.queue: deque[Span] = deque()
        self.queued = 0
        """Items in `queue`."""
        self.workers: list[_Worker] = []
        self.pending = 0
        self.seq = 0
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pump_scheduled = False
        self._watchdog: asyncio.Task | None = None
        self._startup_failures = [0] * self.n_workers
        self.restarts = 0

    # -- lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for slot in range(self.n_workers):
            self.workers.append(self._spawn(slot))
        self._watchdog = asyncio.create_task(self._watch())

    def _spawn(self, slot: int) -> _Worker:
        worker = _Worker(slot)
        inbox_r, inbox_w = self.ctx.Pipe(duplex=False)
        outbox_r, outbox_w = self.ctx.Pipe(duplex=False)
        worker.progress = self.ctx.RawArray("d", 3)
        worker.proc = self.ctx.Process(
            target=_worker_main,
            args=(
                inbox_r,
                outbox_w,
                worker.progress,
                tuple(self.cfg.plugins),
                self.cfg.time_limit_s,
                self.cfg.check_cache_size,
            ),
            name=f"mmrl-verifier-{slot}",
            daemon=True,
        )
        worker.proc.start()
        inbox_r.close()  # the child's ends: closing ours lets EOF mean "the other side is gone"
        outbox_w.close()
        loop = self.loop
        assert loop is not None

        async def connect() -> None:
            worker.writer, _ = await loop.connect_write_pipe(asyncio.Protocol, inbox_w)
            worker.reader, _ = await loop.connect_read_pipe(
                lambda: _Reader(functools.partial(self._on_frame, worker)), outbox_r
            )

        loop.create_task(connect())
        loop.add_reader(worker.proc.sentinel, self._on_exit, worker)
        return worker

    async def close(self) -> None:
        self.closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for worker in self.workers:
            if worker.writer is not None:
                worker.writer.close()  # the worker reads EOF and returns
        deadline = time.monotonic() + 3.0
        while any(w.proc.is_alive() for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(worker.proc.sentinel)
            if worker.proc.is_alive():
                worker.proc.kill()
            worker.proc.join(1.0)
            if worker.reader is not None:
                worker.reader.close()
        for job, _, _ in self.queue:
            self._fail(job, "the server is shutting down")
        for worker in self.workers:
            for spans, _ in worker.chunks.values():
                for job, _, _ in spans:
                    self._fail(job, "the server is shutting down")
        self.queue.clear()
        self.queued = 0

    # -- submitting work

    def run(self, items: list[WireItem], timeout_s: float) -> Job:
        """Queue a request's items; `job.future` resolves when every item has a result in
        `job.results` (or the request's time limit passed: the rest get timeout errors).
        Raises `Busy` instead of queueing past `max_pending`."""
        loop = self.loop
        job = Job(items, loop.create_future())
        if not items:
            job.finish()
            return job
        if self.pending + len(items) > self.cfg.max_pending:
            raise Busy(
                f"{self.pending} samples are pending and this request adds {len(items)} (limit {self.cfg.max_pending})"
            )
        self.pending += len(items)
        self.queue.append([job, 0, len(items)])
        self.queued += len(items)
        job.timer = loop.call_later(timeout_s, self._expire, job, timeout_s)
        self._schedule_pump()
        return job

    def _expire(self, job: Job, timeout_s: float) -> None:
        if job.done:
            return
        message = f"timeout: the request's {timeout_s:g}s limit passed before this sample was scored"
        for i, result in enumerate(job.results):
            if result is None:
                job.results[i] = (0.0, {}, message, None, None)
                self.metrics.sample_done(job.items[i][0][0], "timeout")
        job.remaining = 0
        job.finish()

    def _fail(self, job: Job, message: str) -> None:
        for i, result in enumerate(job.results):
            if result is None:
                job.set(i, (0.0, {}, message, None, None))

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Send queued items to workers with a free pipeline slot, the queue split evenly
        between them (at most `max_chunk` per message), least-loaded worker first."""
        self._pump_scheduled = False
        queue = self.queue
        if not queue:
            return
        free = [w for w in self.workers if w.ready and not w.dead and len(w.chunks) < PIPELINE_DEPTH]
        if not free:
            return
        size = min(self.cfg.max_chunk, math.ceil(self.queued / len(free)))
        while queue and free:
            worker = min(free, key=lambda w: w.n_items)
            spans: list[Span] = []
            n = 0
            while queue and n < size:
                span = queue[0]
                job, start, end = span
                if job.done:  # its request timed out
                    queue.popleft()
                    self.queued -= end - start
                    self.pending -= end - start
                    continue
                take = min(end - start, size - n)
                spans.append([job, start, start + take])
                n += take
                self.queued -= take
                if start + take == end:
                    queue.popleft()
                else:
                    span[1] = start + take
            if not spans:
                return
            self.seq += 1
            try:
                payload = pickle.dumps((self.seq, _span_items(spans)), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - e.g. a ground truth nested too deeply to pickle
                spans = self._drop_unpicklable(spans)
                if not spans:
                    continue
                n = sum(end - start for _, start, end in spans)
                payload = pickle.dumps((self.seq, _span_items(spans)), protocol=pickle.HIGHEST_PROTOCOL)
            worker.chunks[self.seq] = (spans, n)
            worker.n_items += n
            worker.writer.write(_frame(payload))
            if len(worker.chunks) >= PIPELINE_DEPTH:
                free.remove(worker)

    def _drop_unpicklable(self, spans: list[Span]) -> list[Span]:
        """The items of `spans` that can be sent (as one-item spans); the others get an error
        result now."""
        keep = []
        for job, start, end in spans:
            for index in range(start, end):
                try:
                    pickle.dumps(job.items[index], protocol=pickle.HIGHEST_PROTOCOL)
                    keep.append([job, index, index + 1])
                except Exception as exc:  # noqa: BLE001
                    self.pending -= 1
                    error = f"cannot send this sample to a verifier worker: {type(exc).__name__}: {exc}"
                    if job.set(index, (0.0, {}, error, None, None)):
                        self.metrics.sample_done(job.items[index][0][0], "error")
        return keep

    # -- worker events

    def _on_frame(self, worker: _Worker, data: bytes) -> None:
        seq, payload = pickle.loads(data)
        if seq == "ready":
            worker.ready = True
            self._startup_failures[worker.slot] = 0
            log.info("verifier worker %d ready (pid %d)", worker.slot, payload)
            self._schedule_pump()
            return
        sent = worker.chunks.pop(seq, None)
        if sent is None:
            return
        spans, n = sent
        worker.n_items -= n
        self.pending -= n
        offset = 0
        for job, start, end in spans:
            results = payload[offset : offset + end - start]
            offset += end - start
            if job.fill(start, results):  # else the request timed out meanwhile
                self.metrics.results_done(job.items[start:end], results)
        self._schedule_pump()

    def _on_exit(self, worker: _Worker) -> None:
        """The worker process ended (killed by the watchdog, crashed, or shut down)."""
        loop = self.loop
        loop.remove_reader(worker.proc.sentinel)
        if worker.dead:
            return
        worker.dead = True
        worker.proc.join(0.5)
        code = worker.proc.exitcode
        for transport in (worker.writer, worker.reader):
            if transport is not None:
                transport.close()
        if self.closing:
            return
        reason = worker.kill_reason or (
            f"the verifier worker process died while scoring this sample (exit code {code}); it was replaced"
        )
        seq, index, started = worker.progress[0], worker.progress[1], worker.progress[2]
        blamed = (int(seq), int(index)) if started > 0 else None
        requeue, culprit = _take_back(worker.chunks, blamed)
        if culprit is not None:
            job, item = culprit
            self.pending -= 1
            if job.set(item, (0.0, {}, reason, None, None)):
                kind = "timeout" if worker.kill_reason else "crash"
                self.metrics.sample_done(job.items[item][0][0], kind)
        worker.chunks.clear()
        self.queue.extendleft(reversed(requeue))
        self.queued += sum(end - start for _, start, end in requeue)
        self._schedule_pump()
        if worker.ready:
            log.warning("verifier worker %d (pid %s) ended: %s", worker.slot, worker.proc.pid, reason)
            delay = 0.0
        else:
            self._startup_failures[worker.slot] += 1
            delay = min(30.0, 0.5 * 2 ** self._startup_failures[worker.slot])
            log.error(
                "verifier worker %d exited with code %s before it was ready (plugins failing to import?); "
                "retrying in %.1fs",
                worker.slot,
                code,
                delay,
            )
        self.restarts += 1
        self.metrics.worker_restarts += 1
        loop.call_later(delay, self._replace, worker)

    def _replace(self, worker: _Worker) -> None:
        if self.closing:
            return
        self.workers[worker.slot] = self._spawn(worker.slot)

    async def _watch(self) -> None:
        limit = self.cfg.time_limit_s + self.cfg.kill_grace_s
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            for worker in self.workers:
                if worker.dead or not worker.chunks or worker.kill_reason:
                    continue
                started = worker.progress[2]
                if started > 0 and now - started > limit:
                    worker.kill_reason = (
                        f"timeout: the verifier ran past {self.cfg.time_limit_s:g}s (+{self.cfg.kill_grace_s:g}s grace) "
                        "and its worker process was killed"
                    )
                    log.warning(
                        "killing verifier worker %d (pid %s): %s",
                        worker.slot,
                        worker.proc.pid,
                        worker.kill_reason,
                    )
                    worker.proc.kill()

    # -- state

    @property
    def ready_workers(self) -> int:
        return sum(1 for w in self.workers if w.ready and not w.dead)


# ---------------------------------------------------------------------------------------------
# Metrics (Prometheus text format)


class Metrics:
    """Counters and a latency histogram, rendered in Prometheus' text exposition format."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.latency: dict[str, list[int]] = {}
        self.latency_sum: Counter = Counter()
        self.samples: Counter = Counter()
        self.errors: Counter = Counter()
        self.worker_restarts = 0

    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[(endpoint, status)] += 1
        buckets = self.latency.get(endpoint)
        if buckets is None:
            buckets = self.latency[endpoint] = [0] * (len(LATENCY_BUCKETS) + 1)
        buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[endpoint] += seconds

    def sample_done(self, verifier: str, error_kind: str | None) -> None:
        self.samples[verifier] += 1
        if error_kind is not None:
            self.errors[(verifier, error_kind)] += 1

    def results_done(self, items: list[WireItem], results: list[WireResult]) -> None:
        """Count workers' results (an error kind: invalid sample, timeout or error)."""
        samples = self.samples
        for item, result in zip(items, results):
            verifier = item[0][0]
            samples[verifier] += 1
            if type(result) is tuple and result[2] is not None:
                kind = (
                    "invalid"
                    if result[4] is not None
                    else "timeout"
                    if result[2].startswith("timeout")
                    else "error"
                )
                self.errors[(verifier, kind)] += 1

    def render(self, pool: WorkerPool) -> str:
        lines = [
            "# HELP mmrl_requests_total HTTP requests by endpoint and status.",
            "# TYPE mmrl_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'mmrl_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        lines += [
            "# HELP mmrl_request_duration_seconds Request latency by endpoint.",
            "# TYPE mmrl_request_duration_seconds histogram",
        ]
        for endpoint, buckets in sorted(self.latency.items()):
            total = 0
            for bound, n in zip((*LATENCY_BUCKETS, math.inf), buckets):
                total += n
                le = "+Inf" if bound == math.inf else repr(bound)
                lines.append(
                    f'mmrl_request_duration_seconds_bucket{{endpoint="{endpoint}",le="{le}"}} {total}'
                )
            lines.append(
                f'mmrl_request_duration_seconds_sum{{endpoint="{endpoint}"}} {self.latency_sum[endpoint]:.6f}'
            )
            lines.append(f'mmrl_request_duration_seconds_count{{endpoint="{endpoint}"}} {total}')
        lines += [
            "# HELP mmrl_samples_total Responses scored, by verifier.",
            "# TYPE mmrl_samples_total counter",
        ]
        for verifier, n in sorted(self.samples.items()):
            lines.append(f'mmrl_samples_total{{verifier="{_label(verifier)}"}} {n}')
        lines += [
            "# HELP mmrl_verifier_errors_total Scoring errors by verifier and kind (error, timeout, crash, invalid).",
            "# TYPE mmrl_verifier_errors_total counter",
        ]
        for (verifier, kind), n in sorted(self.errors.items()):
            lines.append(f'mmrl_verifier_errors_total{{verifier="{_label(verifier)}",kind="{kind}"}} {n}')
        lines += [
            "# HELP mmrl_pending_samples Samples queued or being scored.",
            "# TYPE mmrl_pending_samples gauge",
            f"mmrl_pending_samples {pool.pending}",
            "# HELP mmrl_workers_ready Verifier worker processes ready to score.",
            "# TYPE mmrl_workers_ready gauge",
            f"mmrl_workers_ready {pool.ready_workers}",
            "# HELP mmrl_worker_restarts_total Verifier worker processes replaced (killed or crashed).",
            "# TYPE mmrl_worker_restarts_total counter",
            f"mmrl_worker_restarts_total {self.worker_restarts}",
        ]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
    pool = WorkerPool(cfg, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await pool.start()
        _freeze_heap()
        log.info(
            "mmrl reward server: %d verifier workers; verifiers: %s", pool.n_workers, ", ".join(sorted(known))
        )
        try:
            yield
        finally:
            await pool.close()

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
    return RewardEndpoints(app, _Endpoints(cfg, pool, metrics, known, guard))


class _Endpoints:
    """The handlers: `(body) -> (status, payload)`, payload a JSON-able object, `JSONBody` or
    text bytes; errors are raised as `RequestError`/`Busy`."""

    def __init__(
        self,
        cfg: ServeConfig,
        pool: WorkerPool,
        metrics: Metrics,
        known: frozenset[str],
        guard: ConnectionGuard | None = None,
    ):
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.known = known
        self.guard = guard
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
        self, batch: protocol.ParsedBatch, rename: Callable[[str], str] = str
    ) -> list[WireResult]:
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
        for where, result in zip(batch.wheres, results):
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
        batch = protocol.parse_score_request(data, self.known, self.cfg.max_batch, self.cfg.check_images)
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
                data, self.known, self.cfg.judge_format_ratio, self.cfg.judge_iou_threshold
            )
            results = await self._scored(batch, protocol.judge_field)
        except RequestError as exc:
            verifier = data.get("reward_verifier") if isinstance(data, dict) else None
            self.metrics.sample_done(str(verifier or "unknown"), "invalid")
            log.warning("/judge could not score a sample (%d): %s", exc.status, exc.message)
            return 200, protocol.judge_failure_json(data, exc.message)
        if type(results[0]) is tuple and results[0][2] is not None:
            log.warning("/judge verifier error: %s", results[0][2])
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
                await self._read_body(headers.get(b"content-length"), receive) if route[0] == b"POST" else b""
            )
            status, payload = await handler(body)
        except RequestError as exc:
            status, payload = exc.status, {"detail": exc.message}
            if exc.status == 401:
                extra = [(b"www-authenticate", b"Bearer")]
            elif exc.status == 413:
                extra = [(b"connection", b"close")]
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


# ---------------------------------------------------------------------------------------------
# A server in a child process (tests, benchmarks, notebooks)


class ServerProcess:
    """A `mmrl serve` child process; `url` is its base URL. Stop it with `stop()` or `with`."""

    def __init__(self, proc: Any, url: str, log_path: str, tmpdir: Any):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self._tmpdir = tmpdir

    def log_text(self) -> str:
        """Everything the server wrote to stdout/stderr so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 15.0) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmpdir.cleanup()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_process(
    cfg: ServeConfig,
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 180.0,
    all_workers: bool = True,
) -> ServerProcess:
    """Start `mmrl serve` with `cfg` in a child process and wait until it is ready (every worker
    warm with `all_workers`). `cfg.port` 0 picks a free loopback port. Raises `RuntimeError`
    with the server's log if it exits or does not become ready in time."""
    import subprocess
    import tempfile
    import urllib.request

    from omegaconf import OmegaConf

    cfg.validate()
    port = cfg.port
    bind = cfg.bind_address()
    if port == 0:
        with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
            s.bind((bind, 0))
            port = s.getsockname()[1]
    tmpdir = tempfile.TemporaryDirectory(prefix="mmrl-serve-")
    config_path = os.path.join(tmpdir.name, "serve.yaml")
    with open(os.open(config_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    log_path = os.path.join(tmpdir.name, "serve.log")
    code = "import sys; from mmrl.server import main; sys.exit(main(sys.argv[1:]))"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--config", config_path, "--port", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    host = f"[{bind}]" if ":" in bind else bind
    server = ServerProcess(proc, f"http://{host}:{port}", log_path, tmpdir)
    wanted = cfg.resolved_workers() if all_workers else 1
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            text = server.log_text()
            server.stop()
            raise RuntimeError(f"the reward server exited with status {proc.returncode}:\n{text}")
        try:
            with urllib.request.urlopen(server.url + "/ready", timeout=2) as answer:
                if json.loads(answer.read())["workers_ready"] >= wanted:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            text = server.log_text()
            server.stop()
            raise RuntimeError(f"the reward server was not ready after {ready_timeout_s:g}s:\n{text}")
        time.sleep(0.1)
