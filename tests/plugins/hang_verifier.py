"""A test-only verifier that hangs inside C code for some samples (a catastrophic regex:
CPython's regex engine never checks for signals, so only killing the process stops it)."""

from __future__ import annotations

import re

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.math import MathVerifier
from mmrl.verifiers.registry import register_verifier


@register_verifier("hang_on_marked")
class HangOnMarked(MathVerifier):
    """The math verifier, except that samples with `extra_info["hang"]` never return."""

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        if sample.extra_info.get("hang"):
            re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking in C
        return super().score(response, sample, context)


@register_verifier("nan_on_marked")
class NaNOnMarked(MathVerifier):
    """The math verifier, except that samples with `extra_info["nan"]` score NaN (a broken
    reward the trainer's numeric guard must catch)."""

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        result = super().score(response, sample, context)
        if sample.extra_info.get("nan"):
            result.score = float("nan")
        return result


@register_verifier("error_on_marked")
class ErrorOnMarked(MathVerifier):
    """The math verifier, except that it raises on samples with `extra_info["error"]` (a verifier
    error: the row scores 0 with the error recorded, or is dropped with `reward.on_error=drop`)."""

    def score(self, response: str, sample: Sample, context: VerifyContext) -> VerifierResult:
        if sample.extra_info.get("error"):
            raise ValueError("marked to fail")
        return super().score(response, sample, context)
