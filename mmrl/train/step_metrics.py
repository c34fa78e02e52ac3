"""What a training step reports, overall and per data source (V-Triune's source-level monitoring).

Names are `group/name` overall and `group/name/<data_source>` per source:
- `reward/<component>`: every component every verifier returned (accuracy, format, iou, map,
  precision@0.5, ...), and `reward/mean`;
- `response/length_mean`, `response/clip_ratio` (hit the length limit), each also for
  `correct` and `wrong` responses (`response/length_mean/correct`, ...);
- `reflection/ratio` (responses with a reflection word), `reflection/ratio_in_correct`,
  `reflection/ratio_in_wrong`, `reflection/accuracy` (accuracy of reflective responses);
- `verifier/errors`, `verifier/timeouts` (also per `verifier/data_source`), and
  `verifier/rejected_answers` (errors of answers past a size cap, also per kind:
  `verifier/rejected_answers/answer_too_long`, ...; `reward.answer_limits`).

A response is *correct* when its `accuracy` component is at least 0.5 (1 for binary verifiers;
graded ones like detection count as correct past half credit).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import torch

from mmrl.router import RewardBatch
from mmrl.types import RolloutBatch
from mmrl.verifiers.limits import answer_limit_kind

REFLECTION_WORDS = (
    "wait",
    "re-check",
    "recheck",
    "re-examine",
    "reconsider",
    "double-check",
    "double check",
    "verify",
    "however",
    "but wait",
    "let me check",
    "mistake",
    "actually",
    "alternatively",
)
_REFLECTION = re.compile(r"\b(" + "|".join(re.escape(w) for w in REFLECTION_WORDS) + r")\b", re.IGNORECASE)
CORRECT_THRESHOLD = 0.5


def has_reflection(text: str) -> bool:
    return _REFLECTION.search(text) is not None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_metrics(
    batch: RolloutBatch, rewards: RewardBatch, advantages: torch.Tensor, group_size: int
) -> dict[str, float]:
    """Reward, response, reflection, advantage and verifier statistics for one step."""
    scores = rewards.scores
    grouped = scores.view(-1, group_size)
    metrics: dict[str, float] = {
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/zero_variance_groups": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
        "adv/mean": float(advantages.mean()),
        "adv/std": float(advantages.std()) if len(advantages) > 1 else 0.0,
        "adv/abs_max": float(advantages.abs().max()),
        "verifier/errors": float(sum(rewards.errors.values())),
        "verifier/timeouts": float(sum(rewards.timeouts.values())),
    }
    for key, count in rewards.errors.items():
        metrics[f"verifier/errors/{key}"] = float(count)
    for key, count in rewards.timeouts.items():
        metrics[f"verifier/timeouts/{key}"] = float(count)
    rejected = Counter(answer_limit_kind(r.error) for r in rewards.results if r.error is not None)
    rejected.pop(None, None)
    metrics["verifier/rejected_answers"] = float(sum(rejected.values()))
    for kind, count in sorted(rejected.items()):
        metrics[f"verifier/rejected_answers/{kind}"] = float(count)

    lengths = batch.response_mask.sum(dim=1).float().tolist()
    truncated = batch.truncated.float().tolist()
    rows_by_source: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(batch.samples):
        rows_by_source[sample.data_source].append(i)
    for suffix, rows in [("", list(range(len(scores))))] + [
        (f"/{s}", r) for s, r in sorted(rows_by_source.items())
    ]:
        metrics.update(_group_metrics(rows, batch, rewards, lengths, truncated, suffix))
    return metrics


def component_means(rows: list[int], batch: RolloutBatch, rewards: RewardBatch) -> dict[str, float]:
    """`{component: mean}` over the rows that can have it: every row scored without error by a
    verifier that reported the component in one of `rows`, counting 0 where it left it out (the
    math verifier reports `malformed` only when an answer is malformed: averaging over the rows
    that report it read 1.0 whatever the share). Model rewards (`model/<name>`) average over the
    rows whose samples asked for them, the rows that have them."""
    verifier = [batch.samples[i].reward_model.verifier for i in range(len(batch.samples))]
    scored = [i for i in rows if rewards.results[i].error is None]
    reporters: dict[str, set[str]] = defaultdict(set)
    for i in scored:
        for name in rewards.results[i].components:
            reporters[name].add(verifier[i])
    means = {}
    for name, verifiers in reporters.items():
        if name.startswith("model/"):
            values = [
                rewards.results[i].components[name] for i in rows if name in rewards.results[i].components
            ]
        else:
            values = [
                rewards.results[i].components.get(name, 0.0) for i in scored if verifier[i] in verifiers
            ]
        means[name] = sum(float(v) for v in values) / len(values)
    return means


def _group_metrics(rows, batch, rewards, lengths, truncated, suffix: str) -> dict[str, float]:
    out: dict[str, float] = {f"reward/mean{suffix}": float(rewards.scores[rows].mean())}
    for name, mean in component_means(rows, batch, rewards).items():
        out[f"reward/{name}{suffix}"] = mean
    accuracy = [rewards.results[i].components.get("accuracy", rewards.results[i].score) for i in rows]
    correct = [i for i, a in zip(rows, accuracy) if a >= CORRECT_THRESHOLD]
    wrong = [i for i, a in zip(rows, accuracy) if a < CORRECT_THRESHOLD]
    reflective = [i for i in rows if has_reflection(batch.texts[i])]
    for label, subset in (("", rows), ("/correct", correct), ("/wrong", wrong)):
        mean_len = _mean([lengths[i] for i in subset])
        if mean_len is not None:
            out[f"response/length_mean{label}{suffix}"] = mean_len
            out[f"response/clip_ratio{label}{suffix}"] = _mean([truncated[i] for i in subset])
    out[f"reflection/ratio{suffix}"] = len(reflective) / len(rows)
    if correct:
        out[f"reflection/ratio_in_correct{suffix}"] = sum(1 for i in correct if i in set(reflective)) / len(
            correct
        )
    if wrong:
        out[f"reflection/ratio_in_wrong{suffix}"] = sum(1 for i in wrong if i in set(reflective)) / len(wrong)
    if reflective:
        acc_by_row = dict(zip(rows, accuracy))
        out[f"reflection/accuracy{suffix}"] = _mean([acc_by_row[i] for i in reflective])
    if suffix == "":
        out["response/length_max"] = max(lengths[i] for i in rows)
    return out
