"""Rollout: left padding, stopping, and log-probs that equal the trainer's recomputation."""

from __future__ import annotations

import torch

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams, response_mask_from_stops
from mmrl.train.batching import select_rows
from mmrl.train.forward import response_logprobs
from mmrl.train.update import old_and_ref_logprobs


def _mixed_samples(n=6):
    # Different kinds have different question lengths, so prompts are left padded.
    return make_samples(["colour_code", "count", "bar_chart"], n, "train")


def test_rollout_logprobs_equal_the_trainers_recomputed_logprobs(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(_mixed_samples(), SamplingParams(n=4, temperature=1.0, max_new_tokens=12))
    assert batch.prompt_mask.sum(1).unique().numel() > 1  # really padded
    assert batch.response_mask.sum() > 0
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)
    # Also at another temperature and for a sub-batch of rows (mini-batching keeps the images).
    batch = engine.generate(_mixed_samples(), SamplingParams(n=2, temperature=0.7, max_new_tokens=12))
    rows = [5, 0, 7, 3]
    with torch.no_grad():
        sub, _ = response_logprobs(tiny_policy.model, select_rows(batch, rows), tiny_policy.blocked, 0.7)
    torch.testing.assert_close(sub, batch.rollout_logprobs[rows], atol=1e-5, rtol=0)


def test_left_padding_does_not_change_greedy_outputs(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = _mixed_samples()
    params = SamplingParams(n=1, greedy=True, max_new_tokens=10)
    together = engine.generate(samples, params).texts
    alone = [engine.generate([s], params).texts[0] for s in samples]
    assert together == alone


def test_responses_stop_at_the_stop_token():
    stop = 9
    response = torch.tensor([[1, 2, 9, 5, 9], [1, 2, 3, 4, 5], [9, 0, 0, 0, 0]])
    mask, truncated = response_mask_from_stops(response, [stop])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_generated_rows_are_prompt_major_and_masked_after_stop(tiny_policy):
    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = _mixed_samples(3)
    batch = engine.generate(samples, SamplingParams(n=5, max_new_tokens=8))
    assert [s.id for s in batch.samples] == [s.id for s in samples for _ in range(5)]
    stop = tiny_policy.stop_token_ids[0]
    for row, mask in zip(batch.response_ids, batch.response_mask):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        stops = (row[:n] == stop).nonzero().flatten().tolist()
        assert stops in ([], [n - 1])  # a stop token can only be the last counted token
    # No blocked token is ever sampled.
    counted = batch.response_ids[batch.response_mask.bool()]
    assert not tiny_policy.blocked[counted].any()


def test_first_on_policy_mini_batch_has_ratio_exactly_one(tiny_policy):
    cfg = load_config(
        "vision_reasoning",
        overrides=["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.mini_batches=2"],
    )
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(_mixed_samples(4), SamplingParams(n=4, max_new_tokens=8))
    old, _ = old_and_ref_logprobs(cfg, tiny_policy, None, batch)
    first = list(range(8))  # the first of two mini-batches, in the order the update uses
    tiny_policy.model.train()
    logprobs, _ = response_logprobs(tiny_policy.model, select_rows(batch, first), tiny_policy.blocked, 1.0)
    ratio = torch.exp(logprobs - old[first])
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_a_checkpoints_own_sampling_defaults_do_not_leak_into_rollouts(tiny_policy):
    """Qwen2.5-VL-Instruct ships top_k=1 / top_p=0.001: rollouts must still sample the plain
    tempered softmax, or the recorded log-probs would describe the wrong distribution."""
    gc = tiny_policy.model.generation_config
    gc.top_k, gc.top_p, gc.temperature = 1, 0.001, 0.1
    engine = HFRolloutEngine.from_policy(tiny_policy)
    batch = engine.generate(_mixed_samples(1), SamplingParams(n=16, temperature=1.0, max_new_tokens=6))
    assert len(set(batch.texts)) > 8  # top_k=1 would give one text
    with torch.no_grad():
        recomputed, _ = response_logprobs(tiny_policy.model, batch, tiny_policy.blocked, 1.0)
    torch.testing.assert_close(recomputed, batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_the_first_mini_batchs_old_logprobs_come_from_the_updates_own_forward(tiny_policy):
    """When nothing reads the old log-probs before the update (`old_from_update`), their pass
    skips the first mini-batch (NaN there, so a read too early is loud) and the update fills
    those rows from its own first forward: the same old log-probs and the same weights after the
    update as with a pass of their own, also when a micro-batch's loss is non-finite (the rows
    after it are filled without a gradient, before the weights move)."""
    import copy

    from mmrl.train.update import old_from_update, update_policy

    base = ["trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.mini_batches=2"]
    cfg = load_config("vision_reasoning", overrides=base)
    assert old_from_update(cfg)
    for reads_them_first in (
        ["algo.tis=token"],
        ["algo.rejection=sequence"],
        ["algo.kl_in_reward=true", "algo.kl_coef=0.01"],
        ["algo.old_logprobs=rollout"],
    ):
        assert not old_from_update(load_config("vision_reasoning", overrides=[*base, *reads_them_first]))
    batch = HFRolloutEngine.from_policy(tiny_policy).generate(
        _mixed_samples(4), SamplingParams(n=4, max_new_tokens=8)
    )
    for micro, advantages in (
        (8, torch.linspace(-1.0, 1.0, 16)),
        # two micro-batches per mini-batch; the first one's loss is NaN: its step is skipped
        (4, torch.cat([torch.full((4,), float("nan")), torch.linspace(-1.0, 1.0, 12)])),
    ):
        run_cfg = load_config("vision_reasoning", overrides=[*base, f"trainer.micro_batch_rows={micro}"])
        separate, left = tiny_policy, copy.deepcopy(tiny_policy)
        full, _ = old_and_ref_logprobs(run_cfg, separate, None, batch)
        part, _ = old_and_ref_logprobs(run_cfg, left, None, batch, first_from_update=True)
        assert torch.isnan(part[:8]).all() and torch.equal(part[8:], full[8:])
        results = []
        for policy, old, flag in ((separate, full, False), (left, part, True)):
            optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
            results.append(
                update_policy(
                    run_cfg, policy, optimizer, batch, advantages, old, None, old_from_first_pass=flag
                )
            )
        assert torch.equal(part, full)
        assert results[0]["actor/skipped_steps"] == results[1]["actor/skipped_steps"] == (micro == 4)
        assert results[0]["actor/ppo_kl"] == results[1]["actor/ppo_kl"]
        for a, b in zip(separate.model.parameters(), left.model.parameters()):
            assert torch.equal(a, b)
