"""Greedy held-out evaluation: accuracy overall and per data source, a progress bar, sample
generations for the trackers, and a clean stop on SIGINT / SIGTERM."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmrl.config import AgentConfig
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.router import Router
from mmrl.stats import mean_interval
from mmrl.types import Sample, VerifyContext


class EvaluationInterrupted(KeyboardInterrupt):
    """A stop was asked (SIGINT / SIGTERM) during an evaluation: it ended between two responses,
    its metrics unlogged. A `KeyboardInterrupt`, so that outside a training loop it ends the
    command like Ctrl-C does (one line, exit status 130)."""


@dataclass
class Evaluation:
    """What one evaluation measured, and the first responses for the trackers' tables."""

    metrics: dict[str, float]
    """`eval/...` metrics."""
    generations: list[dict[str, Any]] = field(default_factory=list)
    """The first `generations` samples' rows: `data_source`, `id`, `prompt`, `image` (the first
    image, or None), `response`, `ground_truth`, `reward` and each reward component."""


def evaluate(
    engine: HFRolloutEngine,
    router: Router,
    samples: list[Sample],
    max_new_tokens: int,
    context: VerifyContext | None = None,
    agent: AgentConfig | None = None,
) -> dict[str, float]:
    """Greedy-decode every sample once and score it. Returns `eval/...` metrics.

    Accuracy is the verifier's `accuracy` component (the final score where a verifier has none).
    Samples that name tools run the multi-turn loop with `agent`.
    """
    return run_evaluation(engine, router, samples, max_new_tokens, context, agent=agent).metrics


def run_evaluation(
    engine: HFRolloutEngine,
    router: Router,
    samples: list[Sample],
    max_new_tokens: int,
    context: VerifyContext | None = None,
    *,
    progress: bool = False,
    should_stop: Callable[[], bool] | None = None,
    generations: int = 0,
    agent: AgentConfig | None = None,
) -> Evaluation:
    """`evaluate`, with a progress bar of finished responses (`progress`), a stop between two
    responses once `should_stop()` is true (`EvaluationInterrupted`), and the rows of the first
    `generations` samples. Samples that name tools run the multi-turn loop with `agent` (the
    config's defaults if None), and the `eval/agent/...` metrics report its turns and tool use."""
    from mmrl.progress import ProgressBar
    from mmrl.rollout.multiturn import generate_trajectories, shape_results, trajectory_metrics

    bar = ProgressBar(
        total=len(samples), desc="held-out eval", unit="resp", disable=not progress, leave=False
    )
    # The HF engine generates `max_batch_rows` rows at once, and their responses finish together
    # near the chunk's end: the bar counts them a chunk at a time. Counted one by one, the first
    # response, which carries its chunk's whole prefill, gave the bar its rate, and an ETA of
    # (responses left) x (that time): hours for an evaluation of seconds.
    rows = getattr(engine, "max_batch_rows", None)
    burst = max(1, min(rows, len(samples))) if isinstance(rows, int) else 1
    done, shown = [0], [0]

    def finished(row: int, text: str) -> None:
        done[0] += 1
        if done[0] - shown[0] >= burst or done[0] == len(samples):
            bar.update(done[0] - shown[0])
            shown[0] = done[0]
        if should_stop is not None and should_stop():
            raise EvaluationInterrupted()

    watch = progress or should_stop is not None
    try:
        params = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens)
        batch = generate_trajectories(
            engine, samples, params, agent or AgentConfig(), on_response=finished if watch else None
        )
    finally:
        bar.close()
    if should_stop is not None and should_stop():
        raise EvaluationInterrupted()
    rewards = router.score(batch.samples, batch.texts, context or VerifyContext())
    results = rewards.results
    if batch.trajectories is not None:  # tool and environment parts, as training scores them
        results = shape_results(results, batch.trajectories, agent or AgentConfig())
    per_source: dict[str, list[float]] = defaultdict(list)
    accuracies = []
    for sample, result in zip(batch.samples, results):
        acc = result.components.get("accuracy", result.score)
        accuracies.append(acc)
        per_source[sample.data_source].append(acc)
    lengths = batch.response_mask.sum(dim=1).float()
    low, high = mean_interval(accuracies)
    metrics = {
        "eval/accuracy": sum(accuracies) / max(len(accuracies), 1),
        "eval/accuracy_low": low,  # its 95% interval (mmrl.stats.mean_interval) over
        "eval/accuracy_high": high,
        "eval/n": float(len(accuracies)),  # this many held-out prompts
        "eval/reward": (
            float(rewards.scores.mean())
            if results is rewards.results
            else sum(r.score for r in results) / max(len(results), 1)
        ),
        "eval/response_length": float(lengths.mean()),
        "eval/verifier_errors": float(sum(rewards.errors.values())),
    }
    if len(per_source) > 1:
        for source, accs in sorted(per_source.items()):
            metrics[f"eval/accuracy/{source}"] = sum(accs) / len(accs)
    metrics.update({f"eval/{k}": v for k, v in trajectory_metrics(batch, 1).items()})
    rows = [
        generation_row(sample, text, result)
        for sample, text, result in zip(batch.samples[:generations], batch.texts, results)
    ]
    return Evaluation(metrics, rows)


def generation_row(sample: Sample, response: str, result: Any) -> dict[str, Any]:
    """One row of the generations table: what was asked, shown and answered, and how it scored."""
    return {
        "data_source": sample.data_source,
        "id": sample.id,
        "prompt": prompt_text(sample),
        "image": sample.pil_images()[0] if sample.images else None,
        "response": response,
        "ground_truth": str(sample.reward_model.ground_truth),
        "reward": float(result.score),
        "components": {name: float(value) for name, value in result.components.items()},
        "error": result.error or "",
    }


def prompt_text(sample: Sample) -> str:
    """The text of the sample's last user message (image placeholders as `<image>`)."""
    for message in reversed(sample.prompt):
        if message.get("role") != "user":
            continue
        content = message["content"]
        if isinstance(content, str):
            return content
        return "".join(
            part.get("text", "<image>") if isinstance(part, dict) else str(part) for part in content
        )
    return ""
