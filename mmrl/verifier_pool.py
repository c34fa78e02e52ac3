"""The verifier pool: worker processes that score responses, and survive anything a verifier does.

One pool serves both the trainer (`mmrl.router.Router`, through `PoolThread`) and the reward
server (`mmrl.server.app`). What it guarantees, whatever happens inside a worker:

- Every item submitted gets exactly one result, or an error result that says why: nobody waits
  forever.
- Hard time limits. Each worker records in shared memory which item it is scoring and since
  when. A watchdog kills a worker whose current item has run past `time_limit_s + kill_grace_s`
  (a hang inside C code, which the verifier's own timer signal cannot interrupt).
- Dead workers. A worker that dies (OOM killer, segfault, `os._exit`, SIGKILL) is noticed through
  its process sentinel. Either way the item it was scoring gets an error result (a time-out or a
  crash), the other items it held are queued again, and a replacement worker is spawned.
- Time-outs cancel. When a job's time limit passes (a server request's `timeout_s`), its queued
  items are dropped and the workers still holding any of its items are killed and replaced;
  the other jobs' items they held are queued again, unblamed. A client that sends answers
  which take minutes each holds the workers for its request's time limit at most.
- Signals. Workers ignore SIGINT and SIGTERM: a Ctrl-C or a SIGTERM sent to the whole process
  group (Slurm, systemd's `KillMode=control-group`) is the parent's to handle (the trainer writes
  a checkpoint and exits; the server shuts down); the parent then closes the pool. A worker
  whose parent dies is killed by the kernel (Linux `PR_SET_PDEATHSIG`) or ends on the pipe's EOF.

Design. The pool runs on an asyncio event loop (the server's own; for the trainer, a loop in a
thread of its own, `PoolThread`). Items of all open jobs go into one queue, and each worker is
sent whatever has accumulated as one message (up to `max_chunk` items; `PIPELINE_DEPTH`
messages in flight per worker so it never waits for the loop). What an item is and what a
result is belong to the `Scorer` (a picklable object, sent to every worker): the server's are
wire tuples, the trainer's `(Sample, text, VerifyContext)` and `VerifierResult`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import importlib
import logging
import math
import multiprocessing
import os
import pickle
import signal
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from mmrl.heap import freeze_heap
from mmrl.verifiers.registry import VerifierTimeout, keep_alarm_handler

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 2
"""Messages in flight per worker: the next one is already in its pipe when it finishes one."""
WATCHDOG_PERIOD_S = 0.05
"""How often worker progress is checked against the hard time limit."""
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


class Scorer(Protocol):
    """What the pool's workers run on each item (picklable: it is sent to every worker)."""

    def __call__(self, item: Any, chunk: dict) -> Any:
        """The result of one item. `chunk` is a dict shared by the items of one message (for
        caches that live as long as the message)."""

    def error_result(self, message: str) -> Any:
        """The result that carries an error (`message` starts with "timeout" for time-outs)."""


class PoolEvents:
    """What the pool reports to its owner (the server's metrics); every method may be left as is."""

    def results(self, items: list[Any], results: list[Any]) -> None:
        """Workers' results for `items`."""

    def failed(self, item: Any, kind: str) -> None:
        """An item got an error result from the pool itself: `kind` is "timeout" (killed past
        the limit, or its job's time limit passed), "crash" (its worker died) or "error"."""

    def restarted(self) -> None:
        """A worker was replaced."""


def import_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import modules that register extra verifiers (in this process and in each worker)."""
    for name in modules:
        importlib.import_module(name)


# ---------------------------------------------------------------------------------------------
# The worker process


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this process when its parent ends (it ignores SIGTERM, and a
    stuck verifier would never read the pipe's EOF)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(0)


def _worker_main(inbox, outbox, progress, plugins: tuple[str, ...], scorer: Scorer, parent: int) -> None:
    """Score messages of items until the parent closes the pipe.

    `progress` is shared memory `[message seq, item index, start time]` (start time 0 when
    idle), written before each item so the parent knows what a stuck or dead worker was doing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent)
    from mmrl.verifiers.registry import warm_up_verifiers

    import_plugins(plugins)
    warm_up_verifiers()
    freeze_heap()
    outbox.send_bytes(pickle.dumps(("ready", os.getpid())))
    with keep_alarm_handler():  # this process only scores: the timer is armed only when needed
        while True:
            try:
                data = inbox.recv_bytes()
            except (EOFError, OSError):
                return
            seq, items = pickle.loads(data)
            out = []
            chunk: dict = {}
            for k, item in enumerate(items):
                progress[0] = seq
                progress[1] = k
                progress[2] = time.monotonic()
                try:
                    out.append(scorer(item, chunk))
                except VerifierTimeout:
                    out.append(scorer.error_result("timeout: the verifier ran past its time limit"))
                except Exception as exc:  # noqa: BLE001 - a bug is this item's error, not the worker's end
                    out.append(scorer.error_result(f"{type(exc).__name__}: {exc}"))
            progress[2] = 0.0
            outbox.send_bytes(pickle.dumps((seq, out), protocol=pickle.HIGHEST_PROTOCOL))


# ---------------------------------------------------------------------------------------------
# Jobs and the queue


class Busy(Exception):
    """Accepting the job would exceed `max_pending`."""


class Job:
    """The items of one job (a request, a response) and their results. `future` (an asyncio or
    a `concurrent.futures` future) resolves, to None, when every item has a result."""

    __slots__ = ("items", "results", "remaining", "future", "done", "timer")

    def __init__(self, items: list[Any], future: Any):
        self.items = items
        self.results: list[Any] = [None] * len(items)
        self.remaining = len(items)
        self.future = future
        self.done = False
        self.timer: asyncio.TimerHandle | None = None

    def set(self, index: int, result: Any) -> bool:
        """Record one result; False if the job already had one (or timed out)."""
        return self.results[index] is None and self.fill(index, [result])

    def fill(self, start: int, results: list[Any]) -> bool:
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


Span = list
"""`[job, start, end]`: items `start:end` of a job, queued or sent to a worker together."""


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


def _span_items(spans: list[Span]) -> list[Any]:
    if len(spans) == 1:
        job, start, end = spans[0]
        return job.items[start:end]
    items: list[Any] = []
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


def _ended_how(blamed_reason: str | None, code: int | None, requeued: int) -> str:
    """What a ready worker's end cost, for the log: the reason given to the sample it was
    scoring (`blamed_reason`), or, when it was scoring none, that it died idle or before it
    began the samples it held (queued again)."""
    if blamed_reason is not None:
        return blamed_reason + (f"; its {requeued} other queued samples were sent again" if requeued else "")
    if requeued:
        return (
            f"the verifier worker process died between samples (exit code {code}); it was replaced and "
            f"the {requeued} samples it held were sent again"
        )
    return f"the verifier worker process died while idle (exit code {code}); it was replaced"


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    if n > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _LONG_HEADER.pack(n) + payload
    return _HEADER.pack(n) + payload


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
        "cancelled",
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
        self.cancelled = False
        """Killed because a job it held samples of timed out (not for anything it did)."""


# ---------------------------------------------------------------------------------------------
# The pool


class VerifierPool:
    """Verifier worker processes fed from one queue, on an asyncio event loop (see the module
    docstring). Call `start()`, `run()` and `close()` on the loop's thread.

    Args:
        scorer: what workers run on each item, and the form of an error result.
        workers: worker processes (>= 1).
        time_limit_s: the verifier's own limit; past it plus `kill_grace_s` the worker is killed.
        plugins: modules every worker imports first (they register verifiers).
        max_chunk: most items in one message to a worker.
        max_pending: most items queued or being scored (`run` raises `Busy` past it).
        events: what the pool reports (results, failures, restarts).
        max_startup_failures: a worker that fails to start this many times in a row marks the
            pool broken (`broken` says why; every item gets an error result); None: keep retrying,
            with a growing delay (a server waits for its plugins to be fixed).
        name: the workers' process name prefix.
    """

    def __init__(
        self,
        scorer: Scorer,
        workers: int,
        *,
        time_limit_s: float,
        kill_grace_s: float = 1.0,
        plugins: list[str] | tuple[str, ...] = (),
        max_chunk: int = 64,
        max_pending: int | None = None,
        events: PoolEvents | None = None,
        max_startup_failures: int | None = None,
        name: str = "mmrl-verifier",
    ):
        if workers < 1:
            raise ValueError(f"a verifier pool needs at least one worker, got {workers}")
        self.scorer = scorer
        self.n_workers = workers
        self.time_limit_s = time_limit_s
        self.kill_grace_s = kill_grace_s
        self.plugins = tuple(plugins)
        self.max_chunk = max_chunk
        self.max_pending = max_pending
        self.events = events or PoolEvents()
        self.max_startup_failures = max_startup_failures
        self.name = name
        self.ctx = multiprocessing.get_context("spawn")
        self.queue: deque[Span] = deque()
        self.queued = 0
        """Items in `queue`."""
        self.workers: list[_Worker] = []
        self.pending = 0
        self.seq = 0
        self.closing = False
        self.broken: str | None = None
        """Why the pool cannot score (workers cannot start), or None."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pump_scheduled = False
        self._watchdog: asyncio.Task | None = None
        self._startup_failures = [0] * workers
        self._ready_waiters: list[asyncio.Future] = []
        self.restarts = 0
        self.cancelled_workers = 0
        """Workers killed because a job whose items they held timed out (`_cancel`)."""
        self.sent_messages = 0
        self.sent_items = 0
        """Messages sent to workers and the items they carried (items sent again included)."""

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
            args=(inbox_r, outbox_w, worker.progress, self.plugins, self.scorer, os.getpid()),
            name=f"{self.name}-{slot}",
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

    async def wait_ready(self) -> None:
        """Return once every worker is ready; raise RuntimeError if the pool is broken."""
        while self.ready_workers < self.n_workers:
            if self.broken:
                raise RuntimeError(self.broken)
            waiter = self.loop.create_future()
            self._ready_waiters.append(waiter)
            await waiter
        if self.broken:
            raise RuntimeError(self.broken)

    def _wake_ready_waiters(self) -> None:
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def close(
        self, message: str = "the verifier pool was closed before scoring it", grace_s: float = 3.0
    ) -> None:
        """Stop the workers (each ends when it reads EOF; after `grace_s` it is killed); every
        item without a result gets an error result with `message`."""
        self.closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for worker in self.workers:
            if worker.writer is not None:
                worker.writer.close()  # the worker reads EOF and returns
        deadline = time.monotonic() + grace_s
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
            self._fail(job, message)
        for worker in self.workers:
            for spans, _ in worker.chunks.values():
                for job, _, _ in spans:
                    self._fail(job, message)
            worker.chunks.clear()
        self.queue.clear()
        self.queued = 0
        self._wake_ready_waiters()

    def kill_now(self) -> None:
        """Kill every worker at once (at interpreter exit; no results are given)."""
        self.closing = True
        for worker in self.workers:
            with contextlib.suppress(Exception):
                if worker.proc.is_alive():
                    worker.proc.kill()
                worker.proc.join(1.0)

    # -- submitting work

    def run(self, items: list[Any], timeout_s: float | None = None) -> Job:
        """Queue a job's items; `job.future` resolves when every item has a result in
        `job.results` (or the job's time limit passed: the rest get time-out errors).
        Raises `Busy` instead of queueing past `max_pending`."""
        job = Job(items, self.loop.create_future())
        self.add(job, timeout_s)
        return job

    def add(self, job: Job, timeout_s: float | None = None) -> None:
        """Queue `job` (made by the caller, with a future of its choice); see `run`."""
        items = job.items
        if not items:
            job.finish()
            return
        if self.max_pending is not None and self.pending + len(items) > self.max_pending:
            raise Busy(
                f"{self.pending} samples are pending and this request adds {len(items)} (limit {self.max_pending})"
            )
        if self.broken or self.closing:
            self._fail(job, self.broken or "the verifier pool was closed before scoring it")
            return
        self.pending += len(items)
        self.queue.append([job, 0, len(items)])
        self.queued += len(items)
        if timeout_s is not None:
            job.timer = self.loop.call_later(timeout_s, self._expire, job, timeout_s)
        self._schedule_pump()

    def _expire(self, job: Job, timeout_s: float) -> None:
        """The job's time limit passed: its items without a result get a time-out error, its
        queued items are dropped, and the workers still holding its items are killed and
        replaced (a verifier that takes minutes per sample must not keep the pool busy after
        its request gave up: one client could otherwise hold every worker)."""
        if job.done:
            return
        message = f"timeout: the request's {timeout_s:g}s limit passed before this sample was scored"
        error = self.scorer.error_result(message)
        for i, result in enumerate(job.results):
            if result is None:
                job.results[i] = error
                self.events.failed(job.items[i], "timeout")
        job.remaining = 0
        job.finish()
        self._cancel(job, timeout_s)

    def _cancel(self, job: Job, timeout_s: float) -> None:
        """Drop `job`'s queued items and kill the workers holding any of its items (the other
        items they hold are queued again when their end is noticed, without blame)."""
        if any(span[0] is job for span in self.queue):
            kept: deque[Span] = deque()
            for span in self.queue:
                if span[0] is job:
                    self.queued -= span[2] - span[1]
                    self.pending -= span[2] - span[1]
                else:
                    kept.append(span)
            self.queue = kept
        for worker in self.workers:
            if worker.dead or worker.kill_reason is not None or not worker.chunks:
                continue
            if not any(span[0] is job for spans, _ in worker.chunks.values() for span in spans):
                continue
            worker.cancelled = True
            worker.kill_reason = (
                f"a request's {timeout_s:g}s time limit passed while this worker held its samples"
            )
            self.cancelled_workers += 1
            log.warning(
                "killing verifier worker %d (pid %s): %s; it will be replaced",
                worker.slot,
                worker.proc.pid,
                worker.kill_reason,
            )
            worker.proc.kill()

    def _fail(self, job: Job, message: str) -> None:
        error = self.scorer.error_result(message)
        for i, result in enumerate(job.results):
            if result is None:
                job.set(i, error)

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
        size = min(self.max_chunk, math.ceil(self.queued / len(free)))
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
            self.sent_messages += 1
            self.sent_items += n
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
                    if job.set(index, self.scorer.error_result(error)):
                        self.events.failed(job.items[index], "error")
        return keep

    # -- worker events

    def _on_frame(self, worker: _Worker, data: bytes) -> None:
        seq, payload = pickle.loads(data)
        if seq == "ready":
            worker.ready = True
            self._startup_failures[worker.slot] = 0
            log.info("verifier worker %d ready (pid %d)", worker.slot, payload)
            self._wake_ready_waiters()
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
                self.events.results(job.items[start:end], results)
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
        # A worker killed for a timed-out job did nothing wrong: nothing it held is blamed.
        blamed = (int(seq), int(index)) if started > 0 and not worker.cancelled else None
        requeue, culprit = _take_back(worker.chunks, blamed)
        dropped = sum(end - start for job, start, end in requeue if job.done)  # their jobs timed out
        if dropped:
            self.pending -= dropped
            requeue = [span for span in requeue if not span[0].done]
        if culprit is not None:
            job, item = culprit
            self.pending -= 1
            if job.set(item, self.scorer.error_result(reason)):
                self.events.failed(job.items[item], "timeout" if worker.kill_reason else "crash")
        worker.chunks.clear()
        worker.n_items = 0
        requeued = sum(end - start for _, start, end in requeue)
        self.queue.extendleft(reversed(requeue))
        self.queued += requeued
        self._schedule_pump()
        if worker.cancelled:
            log.info(
                "verifier worker %d (pid %s) was killed (%s); it was replaced%s",
                worker.slot,
                worker.proc.pid,
                worker.kill_reason,
                f" and the {requeued} samples of other requests it held were sent again" if requeued else "",
            )
            delay = 0.0
        elif worker.ready:
            log.warning(
                "verifier worker %d (pid %s) ended: %s", worker.slot, worker.proc.pid,
                _ended_how(reason if culprit is not None or worker.kill_reason else None, code, requeued),
            )  # fmt: skip
            delay = 0.0
        else:
            self._startup_failures[worker.slot] += 1
            failures = self._startup_failures[worker.slot]
            if self.max_startup_failures is not None and failures >= self.max_startup_failures:
                self._break(
                    f"WorkerStartFailed: a verifier worker exited with code {code} before it was ready, "
                    f"{failures} times in a row (do the plugins {list(self.plugins)} import?)"
                )
                return
            delay = min(30.0, 0.5 * 2**failures)
            log.error(
                "verifier worker %d exited with code %s before it was ready (plugins failing to import?); "
                "retrying in %.1fs",
                worker.slot,
                code,
                delay,
            )
        self.restarts += 1
        self.events.restarted()
        loop.call_later(delay, self._replace, worker)

    def _break(self, reason: str) -> None:
        """Workers cannot start: every item queued now or later gets an error result."""
        log.error("%s", reason)
        self.broken = reason
        for job, start, end in self.queue:
            self.pending -= end - start
            self._fail(job, reason)
        self.queue.clear()
        self.queued = 0
        self._wake_ready_waiters()

    def _replace(self, worker: _Worker) -> None:
        if self.closing or self.broken:
            return
        self.workers[worker.slot] = self._spawn(worker.slot)

    async def _watch(self) -> None:
        limit = self.time_limit_s + self.kill_grace_s
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            for worker in self.workers:
                if worker.dead or not worker.chunks or worker.kill_reason:
                    continue
                started = worker.progress[2]
                if started > 0 and now - started > limit:
                    worker.kill_reason = (
                        f"timeout: the verifier ran past {self.time_limit_s:g}s (+{self.kill_grace_s:g}s grace) "
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

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers (tests kill them)."""
        return [w.proc.pid for w in self.workers if not w.dead and w.proc.pid is not None]


# ---------------------------------------------------------------------------------------------
# For synchronous callers: the pool on an event loop in a thread of its own


class PoolThread:
    """A `VerifierPool` running on an event loop in a background thread, for synchronous code
    (the trainer's router). `submit` may be called from any thread; results come back through
    `concurrent.futures` futures. The pool is killed at interpreter exit if not closed before
    (its workers ignore SIGTERM, so `multiprocessing`'s own exit handler could not end them)."""

    def __init__(self, pool: VerifierPool):
        self.pool = pool
        self.loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"{pool.name}-pool", daemon=True
        )
        self._thread.start()
        started.result()
        self._closed = False
        ref = weakref.ref(self)
        self._atexit = functools.partial(_kill_at_exit, ref)
        atexit.register(self._atexit)

    def _run(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.pool.start())
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            started.set_exception(exc)
            return
        started.set_result(None)
        self.loop.run_forever()

    def submit(self, jobs: Iterable[Job]) -> None:
        """Queue jobs made with `concurrent.futures.Future`s (`new_job`)."""
        jobs = list(jobs)
        if not self._thread.is_alive():
            raise RuntimeError("the verifier pool's thread is not running (the pool was closed or failed)")
        self.loop.call_soon_threadsafe(self._add_all, jobs)

    def _add_all(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.pool.add(job)

    @staticmethod
    def new_job(items: list[Any]) -> Job:
        return Job(items, concurrent.futures.Future())

    def wait(self, job: Job) -> list[Any]:
        """The job's results, once it has them all. Raises RuntimeError if the pool's thread
        ended without giving them (a bug) or the pool is broken (workers cannot start)."""
        while True:
            try:
                job.future.result(timeout=1.0)
                break
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive() and not job.future.done():
                    raise RuntimeError("the verifier pool's thread ended before scoring this job") from None
        if self.pool.broken:
            raise RuntimeError(self.pool.broken)
        return job.results

    def call(self, coro_fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """Run `coro_fn()` (a coroutine) on the pool's loop and return its value."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout_s)

    def wait_ready(self) -> None:
        self.call(self.pool.wait_ready)

    def close(
        self, message: str = "the verifier pool was closed before scoring it", grace_s: float = 1.0
    ) -> None:
        """Stop the workers and the thread; items without a result get an error result."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.call(lambda: self.pool.close(message, grace_s))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        else:
            self.pool.kill_now()
        self.loop.close()


def _kill_at_exit(ref: weakref.ref) -> None:
    runner = ref()
    if runner is not None and not runner._closed:
        runner._closed = True
        runner.pool.kill_now()
