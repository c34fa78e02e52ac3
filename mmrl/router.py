"""Routing responses to the verifier each sample names, on worker processes with a hard time limit.

Each response is scored by the verifier its own sample names (`reward_model.verifier`). Scoring
runs on the verifier pool (`mmrl.verifier_pool`, the reward server's too), so a pathological
answer, even one stuck inside C code where no signal can interrupt it (SymPy expanding
`9^{9^{9^9}}`), is killed at the time limit, recorded as an error on that response's result, and
training goes on; a worker that dies (OOM killer, segfault) costs only the response it was
scoring (an error result); the pool replaces the worker and re-queues the rest. Workers ignore
SIGTERM, so a SIGTERM to the whole process group ends the run like one to the trainer alone:
checkpoint, clean exit. With `num_workers=0` scoring runs in-process, limited only by a timer
signal that cannot interrupt C code.

A verifier error is never quietly a 0: the result carries it, `RewardBatch.errors` counts it per
`verifier/data_source`, and it is logged with the sample id. The stated policy: the response
scores 0 and stays in the batch (its group's advantages are computed as usual).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmrl.types import AnswerLimits, Sample, VerifierResult, VerifyContext
from mmrl.verifier_pool import Job, PoolThread, VerifierPool, import_plugins
from mmrl.verifiers.registry import get_verifier, warm_up_verifiers

if TYPE_CHECKING:  # the verifier workers and Ray's reward workers import this module: no torch
    import torch

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
        log_errors(samples, results)
        return cls.of(results, samples)

    @classmethod
    def of(cls, results: list[VerifierResult], samples: list[Sample]) -> RewardBatch:
        """Like `gather`, without logging the errors (a part of a batch that is gathered later)."""
        import torch

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
        import torch

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
        import torch

        return torch.tensor([r.components.get(name, float("nan")) for r in self.results], dtype=torch.float32)


def log_errors(samples: list[Sample], results: list[VerifierResult]) -> None:
    """Log each verifier error with its verifier and sample id."""
    for sample, result in zip(samples, results):
        if result.error is not None:
            log.warning(
                "verifier %s failed on sample %s: %s", sample.reward_model.verifier, sample.id, result.error
            )


def model_reward_failed(
    rewards: RewardBatch, samples: list[Sample], failures: dict[int, tuple[str, str]]
) -> None:
    """Rows whose reward model raised (`failures[row] = (model name, message)`) are treated like
    verifier errors: the row's result carries the error (the verifier's score is kept out:
    the response scores 0, or is dropped with `reward.on_error=drop`), it is logged with the
    sample id and counted under `model/<name>/<data_source>`."""
    for row, (name, message) in sorted(failures.items()):
        sample = samples[row]
        result = rewards.results[row]
        log.warning("reward model %s failed on sample %s: %s", name, sample.id, message)
        if result.error is None:
            result.error = f"reward model {name!r} failed: {message}"
        result.score = 0.0
        rewards.scores[row] = 0.0
        if rewards._keys:
            rewards._keys[row] = f"model/{name}/{sample.data_source}"
    keys = rewards._keys or [f"{s.reward_model.verifier}/{s.data_source}" for s in samples]
    rewards.errors = _count(rewards.results, keys, False)
    rewards.timeouts = _count(rewards.results, keys, True)


def _score_one(sample: Sample, response: str, context: VerifyContext, time_limit_s: float) -> VerifierResult:
    """Runs in a worker process (or in-process with `num_workers=0`)."""
    verifier = get_verifier(sample.reward_model.verifier)
    return verifier(response, sample, context, time_limit_s=time_limit_s)


class _RouterScorer:
    """The trainer's items in the verifier pool: `(sample, response, context)` to a
    `VerifierResult`."""

    def __init__(self, time_limit_s: float):
        self.time_limit_s = time_limit_s

    def __call__(self, item: tuple[Sample, str, VerifyContext], chunk: dict) -> VerifierResult:
        sample, text, context = item
        return _score_one(sample, text, context, self.time_limit_s)

    def error_result(self, message: str) -> VerifierResult:
        return VerifierResult(score=0.0, error=message)


class PendingRewards:
    """Rewards of one batch being computed: responses are added as they finish (possibly while
    others are still being generated); `wait(rows)` waits for some rows, `result()` for all,
    gathered in row order."""

    def __init__(self, router: Router, context: VerifyContext, n_rows: int):
        self.router = router
        self.context = context
        self._futures: list[Future | Job | None] = [None] * n_rows
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
        return [self.router._result(self._futures[row]) for row in rows]


def _count(results: list[VerifierResult], keys: list[str], timeouts_only: bool) -> Counter:
    counts: Counter = Counter()
    for key, result in zip(keys, results):
        if result.error is not None and (not timeouts_only or result.error.startswith("timeout")):
            counts[key] += 1
    return counts


class Router:
    """Dispatches each response to its sample's verifier, on the verifier pool's workers.

    Responses queue up and go to the workers in messages: while every worker is busy,
    responses that finish meanwhile wait and then leave together (up to `MAX_CHUNK` of them),
    so the per-message cost is paid per chunk, not per response; an idle pool gets each
    response at once. Each response has its own soft time limit inside the worker and its own
    hard limit (`time_limit_s + KILL_GRACE_S`, the pool's watchdog kills the worker past it);
    if a worker is killed or dies, only the response it was scoring gets the error, the others
    it held are scored again.

    Args:
        num_workers: worker processes (0: score in this process, no hard time limit).
        time_limit_s: per-call limit; past it (+ `KILL_GRACE_S`) the worker is killed.
        plugins: modules to import first (here and in every worker) that register verifiers.
        answer_limits: the answer-size caps every context scored here carries (None: each
            context's own, `AnswerLimits()` by default).
    """

    MAX_CHUNK = 8
    """Most responses in one message to a worker."""

    def __init__(
        self,
        num_workers: int = 1,
        time_limit_s: float = 5.0,
        plugins: list[str] | tuple[str, ...] = (),
        answer_limits: AnswerLimits | None = None,
    ):
        self.num_workers = num_workers
        self.time_limit_s = time_limit_s
        self.answer_limits = answer_limits
        import_plugins(plugins)
        self._pool: PoolThread | None = None
        if num_workers == 0:
            warm_up_verifiers()
        if num_workers > 0:
            pool = VerifierPool(
                _RouterScorer(time_limit_s),
                num_workers,
                time_limit_s=time_limit_s,
                kill_grace_s=KILL_GRACE_S,
                plugins=plugins,
                max_chunk=self.MAX_CHUNK,
                max_startup_failures=3,
            )
            self._pool = PoolThread(pool)

    @property
    def pool(self) -> VerifierPool | None:
        """The verifier pool (None in-process)."""
        return None if self._pool is None else self._pool.pool

    @property
    def sent_chunks(self) -> int:
        """Messages sent to the workers."""
        return 0 if self._pool is None else self._pool.pool.sent_messages

    @property
    def sent_responses(self) -> int:
        """Responses those messages carried (responses sent again after a worker died included)."""
        return 0 if self._pool is None else self._pool.pool.sent_items

    def start(self, context: VerifyContext, n_rows: int) -> PendingRewards:
        """An empty pending batch; add responses with `.add(row, sample, text)` as they finish."""
        return PendingRewards(self, context, n_rows)

    def submit(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> PendingRewards:
        """Start scoring a whole batch; returns at once in worker mode."""
        if len(samples) != len(texts):
            raise ValueError(f"{len(samples)} samples but {len(texts)} responses")
        pending = self.start(context, len(samples))
        if self._pool is None:
            for row, (sample, text) in enumerate(zip(samples, texts)):
                pending.add(row, sample, text)
            return pending
        jobs = [self._job(sample, text, context) for sample, text in zip(samples, texts)]
        self._pool.submit(jobs)  # queued together, then sent in chunks
        for row, (job, text) in enumerate(zip(jobs, texts)):
            pending._futures[row], pending._texts[row] = job, text
        return pending

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        return self.submit(samples, texts, context).result(samples, texts)

    def _limited(self, context: VerifyContext) -> VerifyContext:
        """`context` carrying this router's answer limits."""
        if self.answer_limits is None or context.limits == self.answer_limits:
            return context
        return dataclasses.replace(context, limits=self.answer_limits)

    def _job(self, sample: Sample, text: str, context: VerifyContext) -> Job:
        light = dataclasses.replace(sample, images=[])  # verifiers never need the pixels
        return PoolThread.new_job([(light, text, self._limited(context))])

    def _start(self, sample: Sample, text: str, context: VerifyContext) -> Future | Job:
        context = self._limited(context)
        if self._pool is None:
            future: Future = Future()
            future.set_result(_score_one(sample, text, context, self.time_limit_s))
            return future
        job = self._job(sample, text, context)
        self._pool.submit([job])
        return job

    def _result(self, handle: Any) -> VerifierResult:
        if isinstance(handle, Job):
            return self._pool.wait(handle)[0] if self._pool is not None else _closed_result(handle)
        return handle.result()

    def warm_up(self) -> float:
        """Start the workers (imports take seconds) before the first timed step; returns seconds.
        Raises RuntimeError if they cannot start (a plugin that fails to import)."""
        start = time.monotonic()
        if self._pool is not None:
            self._pool.wait_ready()
        return time.monotonic() - start

    def close(self) -> None:
        """Stop the workers; responses not scored yet get an error result (nobody waits forever)."""
        if self._pool is not None:
            self._pool.close("RouterClosed: the router was closed before scoring it")

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _closed_result(job: Job) -> VerifierResult:
    return job.results[0] or VerifierResult(
        score=0.0, error="RouterClosed: the router was closed before scoring it"
    )
