"""The training group (FSDP2, data parallel): a 2-process update equals the 1-process update.

The split of rows and the loss shares are checked by hand; the end-to-end check launches two
processes with `torchrun` (gloo on the CPU) on a saved step and compares their parameters with
the single-process trainer's on the same global batch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmrl.config import config_to_yaml, load_config
from mmrl.datasets.procedural import make_samples
from mmrl.distributed.training_group import loss_shares, merge_metrics, rank_rows
from mmrl.models.loading import load_policy
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams
from mmrl.train.grpo import make_trainee


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


# The end-to-end check: the tiny Qwen2-VL, 4 prompts x 4 responses, 2 mini-batches (2 optimizer
# steps), a KL penalty to a frozen reference (the reference is sharded too), micro-batches of 2
# rows (gradient accumulation inside each process), and rows left out of the loss (as
# `reward.on_error=drop` and `algo.mask_truncated` do), so the processes hold unequal numbers of
# tokens and each one's loss share is far from 1/2.
OVERRIDES = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.mini_batches=2",
    "trainer.micro_batch_rows=2",
    "algo.kl_coef=0.05",
    "optim.lr=1e-3",
    "reward.num_workers=0",
]
# Tolerance on the parameters after the update: 2e-5 (2% of one step, lr = 1e-3). The trainer
# computes log-probs and the loss in float32, and a process divides its partial loss by its own
# token count before the share rescales it, so gradients agree to float32 rounding (~1e-7
# relative); Adam's first steps move a weight by lr * g / (|g| + eps), which turns that rounding
# into up to ~5e-6 for weights whose gradient is near 0 (measured: 5.3e-6). Giving each process
# a share of 1/2 instead (averaging the processes' losses, the usual data-parallel shortcut) moves
# weights by 4e-3 here: 200x the tolerance.
PARAM_ATOL = 2e-5


@pytest.mark.slow
def test_two_process_fsdp2_update_equals_the_single_process_update(tmp_path, tiny_policy):
    model_dir = tmp_path / "model"
    tiny_policy.model.save_pretrained(model_dir)
    tiny_policy.processor.save_pretrained(model_dir)
    cfg = load_config("vision_reasoning", overrides=OVERRIDES)
    (tmp_path / "run.yaml").write_text(config_to_yaml(cfg))

    # The global batch: 16 rows of the tiny model's own samples, fixed advantages; rows 4 and 5
    # (the second process's share of the first mini-batch) left out, row 6 cut to one token.
    policy = load_policy(model_dir)
    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    batch = HFRolloutEngine.from_policy(policy).generate(
        make_samples(["colour_code"], 4, "train"), SamplingParams(n=4, max_new_tokens=8)
    )
    batch.response_mask[4:6] = 0
    batch.response_mask[6, 1:] = 0
    advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    torch.save({"batch": batch, "advantages": advantages, "weights": None}, tmp_path / "step.pt")

    # The single-process trainer on the same batch.
    t = make_trainee(cfg, policy)
    old, ref = t.old_and_ref_logprobs(cfg, batch)
    single_metrics = t.update_policy(cfg, batch, advantages, old, ref, None)
    t.close()
    single = {k: v.detach() for k, v in t.policy.model.state_dict().items()}

    # The group: two processes launched by torchrun, gloo on the CPU.
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mmrl.distributed.one_update", "--config", str(tmp_path / "run.yaml"),
           "--model", str(model_dir), "--step", str(tmp_path / "step.pt"), "--out", str(tmp_path / "out.pt")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    group = torch.load(tmp_path / "out.pt", weights_only=False)

    # Each process computed its rows' old and reference log-probs exactly as the single process.
    torch.testing.assert_close(group["old_logprobs"], old, atol=1e-6, rtol=0)
    torch.testing.assert_close(group["ref_logprobs"], ref, atol=1e-6, rtol=0)
    assert group["state_dict"].keys() == single.keys()
    moved = max(float((single[k] - initial[k]).abs().max()) for k in single)
    assert moved > 50 * PARAM_ATOL  # the update really changed the weights
    worst = max(float((group["state_dict"][k] - single[k]).abs().max()) for k in single)
    assert worst <= PARAM_ATOL, f"parameters differ by up to {worst:.2e}"
    assert group["metrics"]["actor/grad_norm"] == pytest.approx(single_metrics["actor/grad_norm"], rel=1e-5)
