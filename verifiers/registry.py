"""The verifier registry and the base class every verifier follows.

This module stands below the verifiers that register into it and imports none of them. The
built-in verifiers register when the package `mmrl.verifiers` is imported, which Python does
before any of its modules, this one included: so `get_verifier("math")` finds the built-ins
whichever way it was imported.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from mmrl.types import Sample, VerifierResult, VerifyContext


class VerifierTimeout(BaseException):
    """A verifier call ran past its time limit.

    A `BaseException`, not an `Exception`: the libraries verifiers call (math-verify, SymPy)
    catch `Exception` and would turn a time-out into an ordinary wrong answer. And even a
    library that catches everything cannot hide one: `call_with_time_limit` records that the
    timer fired and raises it again when the call returns past its deadline."""


class SampleFieldError(ValueError):
    """Raised by `Verifier.check_sample`: what is wrong, and in which field of the record."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def mix_score(sample: Sample, accuracy: float, fmt: float) -> float:
    """The final reward: accuracy and format weighted by the sample's ratios (V-Triune)."""
    rm = sample.reward_model
    return rm.accuracy_ratio * accuracy + rm.format_ratio * fmt


class Verifier:
    """Base class: subclasses implement `score` and may check samples at load time.

    `__call__` wraps `score` with a per-call time limit (a timer signal: it interrupts Python
    code, not C code; the router's worker processes add the hard limit) and turns exceptions
    into an error result (score 0, `error` set) so that callers count and report them.
    """

    name: str = ""

    def check_sample(self, sample: Sample) -> None:
        """Raise `SampleFieldError(field, problem)` if the sample's ground truth or verifier
        params are unusable (`field` like "reward_model.verifier_params.iou_threshold").
        Called once per sample when data is loaded, so bad data fails before training."""

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Import heavy dependencies and build caches before the first timed call (a fresh
        worker process must not spend its first call's time limit importing SymPy)."""

    def __call__(
        self,
        response: str,
        sample: Sample,
        context: VerifyContext | None = None,
        time_limit_s: float = 5.0,
    ) -> VerifierResult:
        context = context or VerifyContext()
        try:
            return call_with_time_limit(lambda: self.score(response, sample, context), time_limit_s)
        except VerifierTimeout:
            return VerifierResult(
                score=0.0, error=f"timeout: {self.name} verifier ran past {time_limit_s:g}s"
            )
        except Exception as exc:  # noqa: BLE001 - any verifier bug becomes a counted error
            return VerifierResult(score=0.0, error=f"{type(exc).__name__}: {exc}")


_REGISTRY: dict[str, Verifier] = {}
V = TypeVar("V", bound=type[Verifier])


def register_verifier(name: str) -> Callable[[V], V]:
    """Class decorator: register a `Verifier` subclass under `name`."""

    def wrap(cls: V) -> V:
        if name in _REGISTRY:
            raise ValueError(f"verifier {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls()
        return cls

    return wrap


def get_verifier(name: str) -> Verifier:
    """The registered verifier called `name` (KeyError if unknown)."""
    return _REGISTRY[name]


def warm_up_verifiers() -> None:
    """`warm_up()` every registered verifier."""
    for verifier in _REGISTRY.values():
        verifier.warm_up()


def verifier_names() -> list[str]:
    """The registered verifier names, sorted."""
    return sorted(_REGISTRY)


_fired = 0
"""How many time-outs the timer handlers have raised (a call compares it before and after, so
a time-out that a library swallowed is still reported)."""


def _time_out() -> None:
    global _fired
    _fired += 1
    raise VerifierTimeout()


def _on_alarm(signum, frame):
    _time_out()


_alarm_kept = False
"""True inside `keep_alarm_handler()`: the SIGALRM handler stays installed between calls."""
_deadline = 0.0
"""Inside `keep_alarm_handler()`: the `time.monotonic()` deadline of the limited call running
now (0: none is)."""


def _on_kept_alarm(signum, frame):
    """The timer of `keep_alarm_handler()` fired: time out the running call if its deadline
    has passed; otherwise (the timer was armed for an earlier call) re-arm it for this one's."""
    if _deadline == 0.0:
        return  # between calls: the next call arms it again
    left = _deadline - time.monotonic()
    if left <= 0.0:
        _time_out()
    signal.setitimer(signal.ITIMER_REAL, left)


def _arm_by(deadline: float, now: float) -> None:
    """Make the timer go off by `deadline`: arm it unless it is already set to fire by then.
    The timer itself is asked (reading it is cheap; setting it is what costs), so code that
    used the same timer meanwhile (`signal.alarm` in a library) cannot leave it unarmed."""
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    if left == 0.0 or now + left > deadline:
        signal.setitimer(signal.ITIMER_REAL, max(deadline - now, 1e-6))


@contextlib.contextmanager
def keep_alarm_handler() -> Iterator[None]:
    """Make the time limits of a block of many limited calls cheap, for processes that do
    nothing else, like a verifier worker: the SIGALRM handler stays installed, and the timer is
    not disarmed after each call but left to run. Each call records its deadline and arms the
    timer only if it would not go off by then; when the timer goes off, the handler times out
    the call running then if its deadline has passed, and otherwise re-arms the timer for that
    deadline (or, between calls, leaves it off). So a stream of calls that end in time costs
    about one timer signal per time limit instead of two timer settings and two handler swaps
    per call. The signal can thus arrive during a call that is within its limit (the handler
    re-arms and returns): Python retries the interrupted system call, as it does for any
    signal. Nested, the outer block's setting stays; outside the main thread it does nothing
    (no limit applies there)."""
    global _alarm_kept, _deadline
    if threading.current_thread() is not threading.main_thread() or _alarm_kept:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_kept_alarm)
    _alarm_kept = True
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _alarm_kept = False
        _deadline = 0.0
        signal.signal(signal.SIGALRM, previous)


def call_with_time_limit(fn: Callable[[], Any], seconds: float) -> Any:
    """Run `fn()`, raising `VerifierTimeout` if it takes longer than `seconds`.

    Uses `ITIMER_REAL`/`SIGALRM`, so the limit is enforced only in the main thread of a process
    (the trainer's, or each worker's in a process pool). Elsewhere `fn` runs without a limit
    and the caller must bound it (the router does, by process). The handler is installed for
    the call and the previous one restored, unless `keep_alarm_handler()` keeps it.

    A time-out is reported even if `fn` (a library inside it) catches the exception: if the
    timer fired for this call and `fn` returned past the deadline, `VerifierTimeout` is raised
    then (the value `fn` returned after its time-out is not trusted).
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return fn()
    now = time.monotonic()
    deadline = now + seconds
    if _alarm_kept and _deadline and _deadline < deadline:
        deadline = _deadline  # a call inside a limited call keeps the outer limit too
    fired = _fired
    value = _limited(fn, seconds, deadline, now)
    if _fired != fired and time.monotonic() >= deadline:
        raise VerifierTimeout()  # the timer fired for this call and something swallowed it
    return value


def _limited(fn: Callable[[], Any], seconds: float, deadline: float, now: float) -> Any:
    global _deadline
    if _alarm_kept:
        outer = _deadline
        try:
            _deadline = deadline
            _arm_by(deadline, now)
            return fn()
        finally:
            _deadline = outer
            if outer:  # back in the outer call: its timer may have gone off for this one
                _arm_by(outer, time.monotonic())

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
