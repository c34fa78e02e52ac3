"""A benchmark-only verifier: the math verifier plus a configurable cost per call.

`verifier_params`: `cost_ms` (float) and `cost_kind`: `sleep` (latency-bound, like a remote
judge or a reward model on another device) or `cpu` (a busy loop, competing for cores).
Loaded into the trainer and its verifier workers with `reward.plugins=[slow_verifier]`.
"""

from __future__ import annotations

import time

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.math import MathVerifier
from mmrl.verifiers.registry import register_verifier


@register_verifier("slow_math")
class SlowMathVerifier(MathVerifier):
    def check_sample(self, sample: Sample) -> None:
        params = dict(sample.reward_model.verifier_params)
        params.pop("cost_ms", None)
        params.pop("cost_kind", None)
        stripped = Sample(**{**sample.__dict__})
        stripped.reward_model = type(sample.reward_model)(
            **{**sample.reward_model.__dict__, "verifier_params": params}
        )
        super().check_sample(stripped)

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        params = sample.reward_model.verifier_params
        cost = float(params.get("cost_ms", 0.0)) / 1000
        if params.get("cost_kind", "sleep") == "cpu":
            end = time.perf_counter() + cost
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(cost)
        return super().score(response, sample, context)
