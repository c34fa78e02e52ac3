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
import importlib
import logging
import multiprocessing
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.registry import get_verifier, warm_up_verifiers

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


class PendingRewards:
    """Rewards of one batch being computed: responses are added as they finish (possibly while
    others are still being generated); `result()` gathers them in row order."""

    def __init__(self, router: Router, context: VerifyContext, n_rows: int):
        self.router = router
        self.context = context
        self._futures: list[Future | VerifierResult | None] = [None] * n_rows
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
        for row, (sample, text) in enumerate(zip(samples, texts)):
            if self._texts[row] != text:
                self.add(row, sample, text)
        results = [_resolve(fut, self.router.time_limit_s) for fut in self._futures]
        return RewardBatch.gather(samples, results)


def _count(results: list[VerifierResult], keys: list[str], timeouts_only: bool) -> Counter:
    counts: Counter = Counter()
    for key, result in zip(keys, results):
        if result.error is not None and (not timeouts_only or result.error.startswith("timeout")):
            counts[key] += 1
    return counts


def _resolve(fut: Future | VerifierResult, time_limit_s: float) -> VerifierResult:
    if isinstance(fut, VerifierResult):
        return fut
    try:
        return fut.result()
    except (FutureTimeout, TimeoutError):
        return VerifierResult(score=0.0, error=f"timeout: killed after {time_limit_s + KILL_GRACE_S:g}s")
    except Exception as exc:  # noqa: BLE001 - a dead worker or unpicklable result is an error result
        return VerifierResult(score=0.0, error=f"{type(exc).__name__}: {exc}")


def import_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import modules that register extra verifiers (in this process and in each worker)."""
    for name in modules:
        importlib.import_module(name)


def _init_worker(plugins: tuple[str, ...]) -> None:
    """Runs once in every (re)started worker, before its first task and outside time limits."""
    import_plugins(plugins)
    warm_up_verifiers()


class Router:
    """Dispatches each response to its sample's verifier.

    Args:
        num_workers: worker processes (0: score in this process, no hard time limit).
        time_limit_s: per-call limit; past it (+ `KILL_GRACE_S`) the worker is killed.
        plugins: modules to import first (here and in every worker) that register verifiers.
    """

    def __init__(
        self, num_workers: int = 1, time_limit_s: float = 5.0, plugins: list[str] | tuple[str, ...] = ()
    ):
        self.num_workers = num_workers
        self.time_limit_s = time_limit_s
        import_plugins(plugins)
        self._pool = None
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
        for row, (sample, text) in enumerate(zip(samples, texts)):
            pending.add(row, sample, text)
        return pending

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
        return self.submit(samples, texts, context).result(samples, texts)

    def _start(self, sample: Sample, text: str, context: VerifyContext) -> Future | VerifierResult:
        if self._pool is None:
            return _score_one(sample, text, context, self.time_limit_s)
        light = dataclasses.replace(sample, images=[])  # verifiers never need the pixels
        return self._pool.schedule(
            _score_one,
            args=(light, text, context, self.time_limit_s),
            timeout=self.time_limit_s + KILL_GRACE_S,
        )

    def warm_up(self) -> float:
        """Start the workers (imports take seconds) before the first timed step; returns seconds."""
        start = time.monotonic()
        if self._pool is not None:
            futures = [self._pool.schedule(get_verifier, args=("math",)) for _ in range(self.num_workers)]
            for f in futures:
                f.result()
        return time.monotonic() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
