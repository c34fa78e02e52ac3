"""Demonstrations in the update (`algo.demo_loss`): which prompts of a rollout batch carry a
reference solution, laid out as a teacher-forced batch, and which of its rows a micro-batch
trains on.

A sample carries a demonstration in `extra_info["demonstration"]`: a reference response (the
text a good response would be, final answer included, in the format the verifier expects). The
built-in procedural tasks provide one for every sample. Each prompt's demonstration trains once
per epoch of the update: in the micro-batch that holds its group's first row. The loss itself
is `mmrl.algos.demonstrations.demonstration_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.models.base import teacher_forced_batch
from mmrl.models.loading import Policy
from mmrl.types import RolloutBatch, Sample

DEMONSTRATION_KEY = "demonstration"
"""The `extra_info` key of a sample's reference solution."""


def demonstration_of(sample: Sample) -> str | None:
    """The sample's demonstration (`extra_info["demonstration"]`), or None if it has none."""
    text = sample.extra_info.get(DEMONSTRATION_KEY)
    if text is None:
        return None
    if not isinstance(text, str) or not text:
        raise ValueError(
            f"sample {sample.id}: field 'extra_info.demonstration' must be a non-empty string, got {text!r}"
        )
    return text


@dataclass
class Demonstrations:
    """The demonstrations of one rollout batch: `batch` has one row per prompt group that has
    one (prompt + demonstration + stop token); `group_row[g]` is group g's row in it, or -1."""

    batch: RolloutBatch
    group_row: list[int]
    group_size: int

    def rows_for(self, rows: list[int]) -> list[int]:
        """The demonstration rows a micro-batch of rollout `rows` trains on: those of the groups
        whose first row is among them (each group exactly once per pass over the batch)."""
        G = self.group_size
        return [self.group_row[r // G] for r in rows if r % G == 0 and self.group_row[r // G] >= 0]

    def tokens_for(self, rows: list[int]) -> float:
        """Demonstration tokens of `rows_for(rows)`, at least 1 (the mini-batch's normaliser)."""
        d = self.rows_for(rows)
        return float(max(int(self.batch.response_mask[d].sum()), 1)) if d else 1.0


def demonstrations(policy: Policy, batch: RolloutBatch, group_size: int) -> Demonstrations | None:
    """The teacher-forced demonstrations of `batch`'s prompt groups (on the batch's device), or
    None if no group's sample carries one."""
    if len(batch) % group_size:
        raise ValueError(f"{len(batch)} rollout rows do not split into groups of {group_size}")
    samples, texts, group_row = [], [], []
    for g in range(len(batch) // group_size):
        sample = batch.samples[g * group_size]
        text = demonstration_of(sample)
        group_row.append(len(samples) if text is not None else -1)
        if text is not None:
            samples.append(sample)
            texts.append(text)
    if not samples:
        return None
    demo = teacher_forced_batch(policy, samples, texts).to(batch.device)
    demo.response_mask = demo.response_mask.to(torch.long)
    return Demonstrations(demo, group_row, group_size)
