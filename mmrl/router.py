"""Routing responses to the verifier each sample names, and collecting per-component rewards.

This is the synchronous router: every response is scored in this process, one after another,
under each verifier's per-call time limit. A verifier error is never quietly a 0: it is kept on
the result, counted in `RewardBatch.errors` and logged with the sample id.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from mmrl.types import Sample, VerifierResult, VerifyContext
from mmrl.verifiers.registry import get_verifier

log = logging.getLogger(__name__)


@dataclass
class RewardBatch:
    """Verifier results for a batch of responses, in row order."""

    results: list[VerifierResult]
    scores: torch.Tensor
    """[N] final rewards."""
    errors: Counter = field(default_factory=Counter)
    """Verifier errors by `verifier/data_source`."""

    def component(self, name: str) -> torch.Tensor:
        """[N] one named component (NaN where a result lacks it)."""
        return torch.tensor(
            [r.components.get(name, float("nan")) for r in self.results], dtype=torch.float32
        )


def score_responses(samples: list[Sample], texts: list[str], context: VerifyContext) -> RewardBatch:
    """Score `texts[i]` against `samples[i]` with the verifier that sample names."""
    results = []
    errors: Counter = Counter()
    for sample, text in zip(samples, texts, strict=True):
        verifier = get_verifier(sample.reward_model.verifier)
        result = verifier(text, sample, context)
        if result.error is not None:
            errors[f"{verifier.name}/{sample.data_source}"] += 1
            log.warning("verifier %s failed on sample %s: %s", verifier.name, sample.id, result.error)
        results.append(result)
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    return RewardBatch(results=results, scores=scores, errors=errors)
