"""The server's counters and latency histogram, rendered in Prometheus' text exposition format
(`GET /metrics`); also the verifier pool's event sink (results, failures, worker restarts)."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import TYPE_CHECKING

from mmrl.server.protocol import WireItem, WireResult
from mmrl.verifier_pool import PoolEvents
from mmrl.verifiers.limits import answer_limit_kind

if TYPE_CHECKING:
    from mmrl.verifier_pool import VerifierPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the request-latency histogram."""


class Metrics(PoolEvents):
    """Counters and a latency histogram, rendered in Prometheus' text exposition format."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.latency: dict[str, list[int]] = {}
        self.latency_sum: Counter = Counter()
        self.samples: Counter = Counter()
        self.errors: Counter = Counter()
        self.worker_restarts = 0
        self.judge_math_compared = 0
        """`/judge` math samples scored both ways (`judge_math: mmrl`)."""
        self.judge_math_disagreed = 0
        """... of which mmrl's verifier and V-Triune's settings disagreed on the accuracy."""

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
                if result[4] is not None:
                    kind = "invalid"
                elif result[2].startswith("timeout"):
                    kind = "timeout"
                else:  # an answer refused by a size cap has its own kind (answer_too_long, ...)
                    kind = answer_limit_kind(result[2]) or "error"
                self.errors[(verifier, kind)] += 1

    # The verifier pool's events
    def results(self, items: list[WireItem], results: list[WireResult]) -> None:
        self.results_done(items, results)

    def failed(self, item: WireItem, kind: str) -> None:
        self.sample_done(item[0][0], kind)

    def restarted(self) -> None:
        self.worker_restarts += 1

    def render(self, pool: VerifierPool) -> str:
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
            "# HELP mmrl_verifier_errors_total Scoring errors by verifier and kind (error, timeout, crash, invalid, "
            "answer_too_long, answer_too_deep, answer_too_many_tokens).",
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
            "# HELP mmrl_judge_math_compared_total /judge math samples scored by mmrl's verifier and by "
            "V-Triune's settings (judge_math: mmrl).",
            "# TYPE mmrl_judge_math_compared_total counter",
            f"mmrl_judge_math_compared_total {self.judge_math_compared}",
            "# HELP mmrl_judge_math_disagreements_total ... of which the two accuracies differed.",
            "# TYPE mmrl_judge_math_disagreements_total counter",
            f"mmrl_judge_math_disagreements_total {self.judge_math_disagreed}",
        ]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
