"""The training group's pieces, checked by hand: the split of rows, the loss shares and the merged
metrics. The end-to-end check (two processes launched by `torchrun`, gloo on the CPU, against the
single-process trainer at every step of three, FSDP2 and DeepSpeed) is
tests/test_distributed_multistep.py.
"""

from __future__ import annotations

import pytest
import torch

from mmrl.config import load_config
from mmrl.distributed.training_group import loss_shares, merge_metrics, rank_rows


def test_each_process_gets_an_equal_contiguous_share_of_every_mini_batch():
    # 12 rows, 2 mini-batches of 6, 3 processes: 2 rows of each mini-batch each.
    assert rank_rows(12, 2, 0, 3) == [0, 1, 6, 7]
    assert rank_rows(12, 2, 1, 3) == [2, 3, 8, 9]
    assert rank_rows(12, 2, 2, 3) == [4, 5, 10, 11]
    assert sorted(r for k in range(3) for r in rank_rows(12, 2, k, 3)) == list(range(12))
    with pytest.raises(ValueError, match="train_workers"):
        rank_rows(12, 2, 0, 4)  # a mini-batch of 6 rows does not split into 4 equal shares


def test_loss_shares_are_each_process_share_of_its_mini_batch_normaliser():
    cfg = load_config(
        "vision_reasoning",
        overrides=["trainer.prompts_per_step=2", "rollout.group_size=4", "trainer.mini_batches=2"],
    )
    # Response lengths 1..8 tokens; mini-batch 0 = rows 0-3 (1+2+3+4 = 10 tokens), 1 = rows 4-7 (26).
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in range(1, 9)])
    # Process 1 of 2 holds rows 2, 3 (3+4 = 7 tokens) and 6, 7 (7+8 = 15 tokens).
    assert loss_shares(cfg, mask, [2, 3, 6, 7]) == pytest.approx([7 / 10, 15 / 26])
    assert loss_shares(cfg, mask, [0, 1, 4, 5]) == pytest.approx([3 / 10, 11 / 26])
    # Micro-batches of one row: one share per forward, each its mini-batch's.
    micro = load_config("vision_reasoning", overrides=[*_overrides(cfg), "trainer.micro_batch_rows=1"])
    assert loss_shares(micro, mask, [2, 3, 6, 7]) == pytest.approx([7 / 10, 7 / 10, 15 / 26, 15 / 26])
    # Sequence-mean aggregation: every row has tokens, so each process holds half of each.
    seq = load_config("vision_reasoning", overrides=[*_overrides(cfg), "algo.loss_agg=seq_mean_token_mean"])
    assert loss_shares(seq, mask, [2, 3, 6, 7]) == pytest.approx([0.5, 0.5])


def _overrides(cfg) -> list[str]:
    t = cfg.trainer
    return [f"trainer.prompts_per_step={t.prompts_per_step}", f"rollout.group_size={cfg.rollout.group_size}",
            f"trainer.mini_batches={t.mini_batches}"]  # fmt: skip


def test_merged_metrics_weight_each_process_by_its_tokens_or_loss_share_per_mini_batch():
    # Two processes, two mini-batches. Mini-batch 0: process 0 holds 3/4 of the loss denominator,
    # process 1 a quarter; mini-batch 1: a half each.
    def m(pg, ent, lo, hi, skipped=0.0, norm=2.0):
        return {"actor/pg_loss": pg, "actor/entropy": ent, "actor/ratio_min": lo, "actor/ratio_max": hi,
                "actor/grad_norm": norm, "actor/skipped_steps": skipped}  # fmt: skip

    p0 = [(m(1.0, 2.0, 0.9, 1.1), 30.0, 0.75), (m(-2.0, 1.0, 0.95, 1.0, norm=4.0), 20.0, 0.5)]
    p1 = [(m(4.0, 1.0, 0.8, 1.3), 10.0, 0.25), (m(6.0, 3.0, 0.9, 1.2, norm=4.0), 20.0, 0.5)]
    merged = merge_metrics([p0, p1])
    # Each mini-batch's loss is the share-weighted sum (1.75 and 2.0); the step's, their mean.
    assert merged["actor/pg_loss"] == pytest.approx((1.0 * 0.75 + 4.0 * 0.25 + (-2.0 * 0.5 + 6.0 * 0.5)) / 2)
    # Token-weighted over every token of the step.
    assert merged["actor/entropy"] == pytest.approx((2.0 * 30 + 1.0 * 10 + 1.0 * 20 + 3.0 * 20) / 80)
    assert (merged["actor/ratio_min"], merged["actor/ratio_max"]) == (0.8, 1.3)
    assert merged["actor/grad_norm"] == pytest.approx(3.0) and merged["actor/skipped_steps"] == 0.0
    # A skipped step (its norm not finite) counts once and leaves the norm's mean.
    p1[1] = (m(6.0, 3.0, 0.9, 1.2, skipped=1.0, norm=float("nan")), 20.0, 0.5)
    p0[1] = (m(-2.0, 1.0, 0.95, 1.0, skipped=1.0, norm=float("nan")), 20.0, 0.5)
    merged = merge_metrics([p0, p1])
    assert merged["actor/skipped_steps"] == 1.0 and merged["actor/grad_norm"] == pytest.approx(2.0)
