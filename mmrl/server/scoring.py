"""What the server's verifier workers run: a wire item (`mmrl.server.protocol`) scored by its
verifier under the time limit, and the pool of workers that runs it (`mmrl.verifier_pool`,
shared with the trainer; its hard time limits, watchdog and replacement of dead workers are
documented there)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from mmrl.server import protocol
from mmrl.server.config import ServeConfig
from mmrl.server.metrics import Metrics
from mmrl.server.protocol import WireItem, WireResult
from mmrl.types import AnswerLimits, VerifyContext
from mmrl.verifier_pool import VerifierPool
from mmrl.verifiers.registry import VerifierTimeout, call_with_time_limit, get_verifier


class WireScorer:
    """The server's items in the verifier pool (`mmrl.verifier_pool`): `WireItem`s to
    `WireResult`s. Sent to every worker; `checked` remembers samples already checked there."""

    def __init__(self, time_limit_s: float, cache_size: int, limits: AnswerLimits | None = None):
        self.time_limit_s = time_limit_s
        self.cache_size = cache_size
        self.limits = limits or AnswerLimits()
        self.checked: OrderedDict = OrderedDict()

    def __call__(self, item: WireItem, chunk: dict) -> WireResult:
        return _score_item(item, self.checked, self.cache_size, self.time_limit_s, chunk, self.limits)

    def error_result(self, message: str) -> WireResult:
        return (0.0, {}, message, None, None)


def _score_item(
    item: WireItem,
    checked: OrderedDict,
    cache_size: int,
    time_limit_s: float,
    samples: dict,
    limits: AnswerLimits | None = None,
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
            context = samples[(step, total_steps)] = VerifyContext(
                step, total_steps, limits or AnswerLimits()
            )
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


def server_pool(cfg: ServeConfig, metrics: Metrics) -> VerifierPool:
    """The verifier pool serving `cfg` (its workers retry forever if plugins fail to import)."""
    return VerifierPool(
        WireScorer(cfg.time_limit_s, cfg.check_cache_size, cfg.answer_limits),
        cfg.resolved_workers(),
        time_limit_s=cfg.time_limit_s,
        kill_grace_s=cfg.kill_grace_s,
        plugins=cfg.plugins,
        max_chunk=cfg.max_chunk,
        max_pending=cfg.max_pending,
        events=metrics,
    )
