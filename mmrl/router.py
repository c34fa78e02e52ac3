"""Routing responses to the verifier each sample names, on worker processes with a hard time limit.

Each response is scored by the verifier its own sample names (`reward_model.verifier`). Scoring
runs on a pool of worker processes (pebble), so a pathological answer, even one stuck inside C
code where no signal can interrupt it (SymPy expanding `9^{9^{9^9}}`), is killed at the time
limit, recorded as an error on that response's result, and training goes on; the pool replaces
the killed worker. With `num_workers=0` scoring runs in-process, limited only by a timer signal
that cannot interrupt C code.

A verifier error is never quietly a 0: the result carries it, `RewardBatch.errors` counts it per
`verifier/data_source`, and it is logged with the sample id. The stated policy: the response
scores 0 and stays in the batch (its group's advantages are computed as usual).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import multiprocessing
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.registry import get_verifier, keep_alarm_handler, warm_up_verifiers

log = logging.getLogger(__name__)

KILL_GRACE_S = 1.0
"""Extra time past the verifier's own limit before its worker process is killed."""


@dataclass
class RewardBatch:
    """Verifier results for a batch of responses, in row order."""

    results: list[VerifierResult]
    scores: torch.Tensor
    """[N] final rewards."""
    errors: Counter = field(default_factory=Counter)
    """Verifier errors (exceptions and time-outs) by `verifier/data_source`."""
    timeouts: Counter = field(default_factory=Counter)
    """Time-outs alone, by `verifier/data_source`."""
    _keys: list[str] = field(default_factory=list, repr=False)
    """`verifier/data_source` of each row (for recounting errors of a selection)."""

    @classmethod
    def gather(cls, samples: list[Sample], results: list[VerifierResult]) -> RewardBatch:
        """The results of a batch in row order; each error is logged with its sample id and
        counted under its sample's `verifier/data_source`."""
        for sample, result in zip(samples, results):
            if result.error is not None:
                log.warning(
                    "verifier %s failed on sample %s: %s",
                    sample.reward_model.verifier,
                    sample.id,
                    result.error,
                )
        return cls.of(results, samples)

    @classmethod
    def of(cls, results: list[VerifierResult], samples: list[Sample]) -> RewardBatch:
        """Like `gather`, without logging the errors (a part of a batch that is gathered later)."""
        keys = [f"{s.reward_model.verifier}/{s.data_source}" for s in samples]
        return cls._counted(results, torch.tensor([r.score for r in results], dtype=torch.float32), keys)

    @classmethod
    def _counted(cls, results: list[VerifierResult], scores: torch.Tensor, keys: list[str]) -> RewardBatch:
        return cls(results=results, scores=scores, errors=_count(results, keys, False),
                   timeouts=_count(results, keys, True), _keys=keys)  # fmt: skip

    def select(self, rows: list[int]) -> RewardBatch:
        """The results of the given rows (errors recounted from them)."""
        return RewardBatch._counted(
            [self.results[r] for r in rows], self.scores[rows], [self._keys[r] for r in rows]
        )

    @staticmethod
    def concat(parts: list[RewardBatch]) -> RewardBatch:
        out = RewardBatch(
            results=[r for p in parts for r in p.results],
            scores=torch.cat([p.scores for p in parts]),
            errors=sum((p.errors for p in parts), Counter()),
            timeouts=sum((p.timeouts for p in parts), Counter()),
        )
        out._keys = [k for p in parts for k in p._keys]
        return out

    def component(self, name: str) -> torch.Tensor:
        """[N] one named component (NaN where a result lacks it)."""
        return torch.tensor([r.components.get(name, float("nan")) for r in self.results], dtype=torch.float32)


def _score_one(sample: Sample, response: str, context: VerifyContext, time_limit_s: float) -> VerifierResult:
    """Runs in a worker process (or in-process with `num_workers=0`)."""
    verifier = get_verifier(sample.reward_model.verifier)
    return verifier(response, sample, context, time_limit_s=time_limit_s)


def _score_chunk(
    items: list[tuple[Sample, str, VerifyContext]], time_limit_s: float
) -> tuple[list[VerifierResult], float]:
    """Runs in a worker process: several responses, each under its own time limit; returns
    their results and the seconds the chunk took."""
    start = time.perf_counter()
    with keep_alarm_handler():  # one handler for the chunk; the timer is armed only when needed
        results = [_score_one(sample, text, context, time_limit_s) for sample, text, context in items]
    return results, time.perf_counter() - start


class PendingRewards:
    """Rewards of one batch being computed: responses are added as they finish (possibly while
    others are still being generated); `wait(rows)` waits for some rows, `result()` for all,
    gathered in row order."""

    def __init__(self, router: Router, context: VerifyContext, n_rows: int):
        self.router = router
        self.context = context
        self._futures: list[Future | None] = [None] * n_rows
        self._texts: list[str | None] = [None] * n_rows

    def add(self, row: int, sample: Sample, text: str) -> None:
        """Start scoring `text` as the response of row `row`."""
        self._futures[row] = self.router._start(sample, text, self.context)
        self._texts[row] = text

    def result(self, samples: list[Sample], texts: list[str]) -> RewardBatch:
        """Wait for every row. Rows never added, or added with a different text than the final
        one, are scored now: the result always matches `texts`."""
        if len(samples) != len(texts) or len(texts) != len(self._futures):
            raise ValueError(f"{len(samples)} samples, {len(texts)} responses, {len(self._futures)} rows")
        return RewardBatch.gather(samples, self.wait(range(len(texts)), samples, texts))

    def wait(self, rows: Iterable[int], samples: list[Sample], texts: list[str]) -> list[VerifierResult]:
        """The results of `rows` alone (`samples` and `texts` are the whole batch's), waiting
        only for them; as in `result`, a row never added or added with another text is scored
        now. Errors are neither logged nor counted here: `result` does that for the batch."""
        rows = list(rows)
        for row in rows:
            if self._texts[row] != texts[row]:
                self.add(row, samples[row], texts[row])
        return [self._futures[row].result() for row in rows]


def _count(results: list[VerifierResult], keys: list[str], timeouts_only: bool) -> Counter:
    counts: Counter = Counter()
    for key, result in zip(keys, results):
        if result.error is not None and (not timeouts_only or result.error.startswith("timeout")):
            counts[key] += 1
    return counts


def _failure(exc: BaseException, time_limit_s: float) -> VerifierResult:
    """The error result of a response whose worker task failed (killed past the limit, a dead
    worker, an unpicklable result)."""
    if isinstance(exc, (FutureTimeout, TimeoutError)):
        return VerifierResult(score=0.0, error=f"timeout: killed after {time_limit_s + KILL_GRACE_S:g}s")
    return VerifierResult(score=0.0, error=f"{type(exc).__name__}: {exc}")


def import_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import modules that register extra verifiers (in this process and in each worker)."""
    for name in modules:
        importlib.import_module(name)


def _init_worker(plugins: tuple[str, ...]) -> None:
    """Runs once in every (re)started worker, before its first task and outside time limits."""
    import_plugins(plugins)
    warm_up_verifiers()


@dataclass
class _Item:
    """One response waiting for a worker, and where its result goes."""

    sample: Sample
    text: str
    context: VerifyContext
    future: Future
    alone: bool = False
    """Sent in a chunk of its own (after its chunk failed: to learn which response it was)."""


class Router:
    """Dispatches each response to its sample's verifier.

    With workers, responses queue up and go to the pool in chunks: while every worker is busy,
    responses that finish meanwhile wait and then leave together, so a worker task carries up
    to `MAX_CHUNK` of them and the per-task cost (pickling, pipes, the pool's threads) is paid
    per chunk, not per response; an idle pool gets each response at once. Each response has
    its own soft time limit inside the worker. A chunk has the hard limit of one response
    (`time_limit_s + KILL_GRACE_S`), and chunks are kept short enough to finish well within it
    (from the measured time per response); if a chunk is killed or its worker dies, each of
    its responses is scored again alone, so only the one at fault gets the error.

    Args:
        num_workers: worker processes (0: score in this process, no hard time limit).
        time_limit_s: per-call limit; past it (+ `KILL_GRACE_S`) the worker is killed.
        plugins: modules to import first (here and in every worker) that register verifiers.
    """

    MAX_CHUNK = 8
    """Most responses in one worker task."""
    CHUNK_BUDGET = 0.1
    """A chunk is sized to take at most this fraction of the time limit."""

    def __init__(
        self, num_workers: int = 1, time_limit_s: float = 5.0, plugins: list[str] | tuple[str, ...] = ()
    ):
        self.num_workers = num_workers
        self.time_limit_s = time_limit_s
        import_plugins(plugins)
        self._pool = None
        self._lock = threading.RLock()  # a chunk may end (and its callback run) while it is sent
        self._queue: deque[_Item] = deque()
        self._out: dict[int, list[_Item]] = {}
        """The chunks at the workers, by task id."""
        self._row_s = 0.0
        """Running mean of a response's scoring time in the workers (sizes the chunks)."""
        self._holding = 0
        """> 0 while `submit` queues a batch (sent when it is all queued)."""
        self.sent_chunks = 0
        self.sent_responses = 0
        """Worker tasks sent and the responses they carried (retries alone included)."""
        if num_workers == 0:
            warm_up_verifiers()
        if num_workers > 0:
            import pebble

            self._pool = pebble.ProcessPool(
                max_workers=num_workers,
                context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tuple(plugins),),
            )

    def start(self, context: VerifyContext, n_rows: int) -> PendingRewards:
        """An empty pending batch; add responses with `.add(row, sample, text)` as they finish."""
        return PendingRewards(self, context, n_rows)

    def submit(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> PendingRewards:
        """Start scoring a whole batch; returns at once in worker mode."""
        if len(samples) != len(texts):
            raise ValueError(f"{len(samples)} samples but {len(texts)} responses")
        pending = self.start(context, len(samples))
        with self._lock:  # queued together, then sent (in chunks)
            self._holding += 1
            try:
                for row, (sample, text) in enumerate(zip(samples, texts)):
                    pending.add(row, sample, text)
            finally:
                self._holding -= 1
                if self._pool is not None:
                    self._dispatch()
        return pending

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        return self.submit(samples, texts, context).result(samples, texts)

    def _start(self, sample: Sample, text: str, context: VerifyContext) -> Future:
        future: Future = Future()
        if self._pool is None:
            future.set_result(_score_one(sample, text, context, self.time_limit_s))
            return future
        light = dataclasses.replace(sample, images=[])  # verifiers never need the pixels
        with self._lock:
            self._queue.append(_Item(light, text, context, future))
            if not self._holding:
                self._dispatch()
        return future

    def _chunk_size(self) -> int:
        """Responses for the next chunk: at most `MAX_CHUNK`, few enough to finish within
        `CHUNK_BUDGET` of the time limit, and an even share of the queue among the workers
        (so the last chunks of a batch do not leave a worker idle). Called with the lock held."""
        if self._row_s <= 0:
            return 1  # nothing measured yet
        fits = int(self.CHUNK_BUDGET * self.time_limit_s / self._row_s)
        share = -(-len(self._queue) // self.num_workers)
        return max(1, min(self.MAX_CHUNK, fits, share))

    def _dispatch(self) -> None:
        """Send queued responses while fewer than two chunks per worker are out (so a worker
        never waits for the next one). Called with the lock held."""
        while self._queue and len(self._out) < 2 * self.num_workers:
            limit = self._chunk_size()
            chunk = [self._queue.popleft()]
            if not chunk[0].alone:
                while self._queue and len(chunk) < limit and not self._queue[0].alone:
                    chunk.append(self._queue.popleft())
            self.sent_chunks += 1
            self.sent_responses += len(chunk)
            task = self._pool.schedule(
                _score_chunk,
                args=([(i.sample, i.text, i.context) for i in chunk], self.time_limit_s),
                timeout=self.time_limit_s + KILL_GRACE_S,
            )
            self._out[id(task)] = chunk
            task.add_done_callback(functools.partial(self._chunk_done, chunk))

    def _chunk_done(self, chunk: list[_Item], task: Future) -> None:
        """Runs on the pool's thread when a chunk ends: hand out its results, or score each of
        a failed chunk's responses again alone; then send more."""
        failed = None
        try:
            results, seconds = task.result()
        except BaseException as exc:  # noqa: BLE001 - killed, dead worker, unpicklable result
            results, seconds, failed = None, 0.0, _failure(exc, self.time_limit_s)
        with self._lock:
            if self._out.pop(id(task), None) is None:
                return  # the router was closed and gave these responses their results
            if results is not None:
                for item, result in zip(chunk, results):
                    item.future.set_result(result)
                per_row = seconds / len(chunk)
                self._row_s = per_row if self._row_s == 0 else 0.8 * self._row_s + 0.2 * per_row
            elif len(chunk) == 1 or self._pool is None:  # alone already, or nothing will retry
                for item in chunk:
                    item.future.set_result(failed)
            else:
                for item in reversed(chunk):
                    item.alone = True
                    self._queue.appendleft(item)
            if self._pool is not None:
                self._dispatch()

    def warm_up(self) -> float:
        """Start the workers (imports take seconds) before the first timed step; returns seconds."""
        start = time.monotonic()
        if self._pool is not None:
            futures = [self._pool.schedule(get_verifier, args=("math",)) for _ in range(self.num_workers)]
            for f in futures:
                f.result()
        return time.monotonic() - start

    def close(self) -> None:
        """Stop the workers; responses not scored yet get an error result (nobody waits forever)."""
        if self._pool is not None:
            with self._lock:
                pool, self._pool = self._pool, None
                unscored = list(self._queue) + [item for chunk in self._out.values() for item in chunk]
                self._queue, self._out = deque(), {}
            closed = VerifierResult(score=0.0, error="RouterClosed: the router was closed before scoring it")
            for item in unscored:
                item.future.set_result(closed)
            pool.stop()
            pool.join()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
