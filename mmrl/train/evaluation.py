"""Greedy held-out evaluation: accuracy overall and per data source."""

from __future__ import annotations

from collections import defaultdict

from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.router import Router
from mmrl.types import Sample, VerifyContext


def evaluate(
    engine: HFRolloutEngine,
    router: Router,
    samples: list[Sample],
    max_new_tokens: int,
    context: VerifyContext | None = None,
) -> dict[str, float]:
    """Greedy-decode every sample once and score it. Returns `eval/...` metrics.

    Accuracy is the verifier's `accuracy` component (the final score where a verifier has none).
    """
    batch = engine.generate(samples, SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
    rewards = router.score(batch.samples, batch.texts, context or VerifyContext())
    per_source: dict[str, list[float]] = defaultdict(list)
    accuracies = []
    for sample, result in zip(batch.samples, rewards.results):
        acc = result.components.get("accuracy", result.score)
        accuracies.append(acc)
        per_source[sample.data_source].append(acc)
    lengths = batch.response_mask.sum(dim=1).float()
    metrics = {
        "eval/accuracy": sum(accuracies) / max(len(accuracies), 1),
        "eval/reward": float(rewards.scores.mean()),
        "eval/response_length": float(lengths.mean()),
        "eval/verifier_errors": float(sum(rewards.errors.values())),
    }
    if len(per_source) > 1:
        for source, accs in sorted(per_source.items()):
            metrics[f"eval/accuracy/{source}"] = sum(accs) / len(accs)
    return metrics
