"""Per-step and per-data-source metrics, worked out by hand on a small batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmrl.router import RewardBatch
from mmrl.train.step_metrics import has_reflection, step_metrics
from mmrl.types import RewardSpec, RolloutBatch, Sample, VerifierResult


def _sample(source: str) -> Sample:
    return Sample(
        source, [{"role": "user", "content": "q"}], [], "math", RewardSpec("1", "math"), {"id": source}
    )


def test_reflection_words():
    assert has_reflection("Wait, let me re-check that.")
    assert has_reflection("I should verify it")
    assert not has_reflection("\\boxed{3}")
    assert not has_reflection("awaiting")  # whole words only


def test_metrics_overall_per_source_and_for_correct_and_wrong_answers():
    samples = [_sample("a"), _sample("a"), _sample("b"), _sample("b")]
    texts = ["\\boxed{1}", "wait, \\boxed{2}", "verify: \\boxed{1}", "\\boxed{5}"]
    lengths = [4, 8, 6, 10]
    mask = torch.zeros(4, 10, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = RolloutBatch(
        samples=samples,
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_ids=torch.zeros(4, 10, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(4, 10),
        vision_inputs={},
        texts=texts,
        truncated=torch.tensor([False, False, False, True]),
        group_size=2,
    )
    results = [
        VerifierResult(1.0, {"accuracy": 1.0, "format": 1.0}),
        VerifierResult(0.0, {"accuracy": 0.0, "format": 1.0}),
        VerifierResult(1.0, {"accuracy": 1.0, "format": 1.0}),
        VerifierResult(0.0, {}, error="timeout: killed after 6s"),
    ]
    rewards = RewardBatch(
        results, torch.tensor([r.score for r in results]), Counter({"math/b": 1}), Counter({"math/b": 1})
    )
    m = step_metrics(batch, rewards, torch.tensor([1.0, -1.0, 1.0, -1.0]), group_size=2)

    assert m["reward/mean"] == 0.5 and m["reward/mean/a"] == 0.5 and m["reward/mean/b"] == 0.5
    assert m["reward/accuracy"] == pytest.approx(2 / 3)  # the errored row has no components
    assert m["reward/format/b"] == 1.0
    assert m["response/length_mean"] == 7.0
    assert m["response/length_mean/correct"] == 5.0  # rows 0 and 2
    assert m["response/length_mean/wrong"] == 9.0  # rows 1 and 3 (an error counts as wrong)
    assert m["response/clip_ratio"] == 0.25 and m["response/clip_ratio/wrong/b"] == 1.0
    assert m["reflection/ratio"] == 0.5
    assert m["reflection/ratio_in_correct"] == 0.5 and m["reflection/ratio_in_wrong"] == 0.5
    assert m["reflection/accuracy"] == 0.5 and m["reflection/accuracy/b"] == 1.0
    assert m["verifier/errors"] == 1 and m["verifier/timeouts/math/b"] == 1
    assert m["reward/zero_variance_groups"] == 0.0


def test_a_component_a_verifier_reports_only_sometimes_averages_over_all_its_rows():
    """The math verifier adds `malformed` only to malformed answers: 1 of 4 here, so 0.25 (it
    used to be averaged over the rows that report it: 1.0 whenever present). A detection row,
    whose verifier never reports it, is not counted; its `iou` averages over detection rows alone;
    a model reward averages over the rows whose samples asked for it."""
    samples = [_sample("a") for _ in range(4)]
    det = Sample(
        "d", [{"role": "user", "content": "q"}], [], "detection", RewardSpec([], "detection"), {"id": "d"}
    )
    samples.append(det)
    batch = RolloutBatch(
        samples=samples,
        prompt_ids=torch.zeros(5, 1, dtype=torch.long),
        prompt_mask=torch.ones(5, 1, dtype=torch.long),
        response_ids=torch.zeros(5, 2, dtype=torch.long),
        response_mask=torch.ones(5, 2, dtype=torch.long),
        rollout_logprobs=torch.zeros(5, 2),
        vision_inputs={},
        texts=["x"] * 5,
        truncated=torch.zeros(5, dtype=torch.bool),
        group_size=1,
    )
    results = [
        VerifierResult(0.0, {"accuracy": 0.0, "format": 0.0, "malformed": 1.0}),
        VerifierResult(1.0, {"accuracy": 1.0, "format": 1.0, "model/judge": 0.5}),
        VerifierResult(0.0, {"accuracy": 0.0, "format": 1.0}),
        VerifierResult(1.0, {"accuracy": 1.0, "format": 1.0, "model/judge": 0.7}),
        VerifierResult(0.6, {"accuracy": 0.6, "iou": 0.8}),
    ]
    rewards = RewardBatch(results, torch.tensor([r.score for r in results]), Counter(), Counter())
    m = step_metrics(batch, rewards, torch.zeros(5), group_size=1)
    assert m["reward/malformed"] == 0.25
    assert m["reward/malformed/a"] == 0.25 and "reward/malformed/d" not in m
    assert m["reward/iou"] == pytest.approx(0.8) and m["reward/format"] == 0.75
    assert m["reward/accuracy"] == pytest.approx(2.6 / 5)
    assert m["reward/model/judge"] == pytest.approx(0.6)
